"""Threads as the tests see them: where a new thread may run."""

from __future__ import annotations

import os
import threading

__all__ = ["start_a_thread"]

JOIN_TIMEOUT_S = 60.0  # the thread only reads its affinity: the bound is for a stalled machine


def start_a_thread() -> list[int]:
    """The CPUs a thread started from the calling thread may run on."""
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join(JOIN_TIMEOUT_S)
    assert not t.is_alive(), f"a thread that reads its affinity ran past {JOIN_TIMEOUT_S:g} s"
    return seen
