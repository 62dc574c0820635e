"""Gate: holds the threads that reach it until the test opens it, and counts who got through.

A test that shows a wait is bounded by its timeout, not by the operation it waits for, holds
that operation at a gate and checks, once the caller has its answer, that nothing got through
the gate yet (``passed == 0``): no clock, so a stall of a loaded machine cannot fail it. The
hold is long (``HOLD_S``) so that a gate never opens by itself while the test runs; the test
opens it itself (``set``), and a gate left shut only costs a failing test that long.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["HOLD_S", "Gate"]

HOLD_S = 60.0  # far above a stall of a loaded 2-core machine


class Gate:
    """``wait()`` (or calling the gate, as a hook) holds the calling thread until ``set()``, at
    most ``hold_s``. ``held``: threads waiting there now; ``passed``: threads that got through
    (the gate opened, or their hold ran out); ``reached``: set once a thread arrives."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self.reached = threading.Event()
        self._open = threading.Event()
        self._lock = threading.Lock()
        self._held = 0
        self._passed = 0

    def wait(self) -> bool:
        """Wait until the gate opens (at most ``hold_s``); True if it did."""
        with self._lock:
            self._held += 1
        self.reached.set()
        try:
            return self._open.wait(self.hold_s)
        finally:
            with self._lock:
                self._held -= 1
                self._passed += 1

    def __call__(self, *args: Any) -> None:
        """As a hook (a store's ``before_copy``): wait at the gate, then let the call go on."""
        self.wait()

    def set(self) -> None:
        """Open the gate: every thread held there goes on, and later ones pass at once."""
        self._open.set()

    def is_set(self) -> bool:
        return self._open.is_set()

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    @property
    def passed(self) -> int:
        with self._lock:
            return self._passed
