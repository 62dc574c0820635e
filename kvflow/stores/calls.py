"""Calls into a native pool client, each bounded in time.

Native clients (Mooncake's, memcache's) block in C++ with no timeout of their own, and some
retry forever while their service is away. ``BoundedCalls`` runs each call on a few threads of
its own and waits at most ``timeout_s``: a hung client costs its caller one timeout
(``StoreUnavailableError``), never a hang; the binding's own exceptions become ``StoreError``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvflow.errors import StoreError, StoreUnavailableError

__all__ = ["BoundedCalls"]


class BoundedCalls:
    """``call(name, fn, *args)``: ``fn(*args)`` on the pool's threads, waited for at most
    ``timeout_s``; ``on_timeout`` runs (on the caller's thread) before the error is raised.
    Thread-safe. A call that timed out keeps its thread until it returns."""

    def __init__(
        self,
        engine: str,
        timeout_s: float,
        on_timeout: Callable[[], None] = lambda: None,
        threads: int = 4,
    ) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kvflow-{engine.lower()}")

    def call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._on_timeout()
            raise StoreUnavailableError(
                f"{self.engine} {name} did not return within {self.timeout_s:g} s"
            ) from None
        except (RuntimeError, ValueError, TypeError) as exc:  # the binding's own errors
            raise StoreError(f"{self.engine} {name} failed: {exc}") from exc

    def shutdown(self) -> None:
        """Stop taking calls; calls still running finish on their threads."""
        self._pool.shutdown(wait=False)
