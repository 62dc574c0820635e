"""Calls into a native pool client, each bounded in time.

Native clients (Mooncake's, memcache's) block in C++ with no timeout of their own, and some
retry forever while their service is away. ``BoundedCalls`` runs each call on a few threads of
its own and waits at most ``timeout_s`` (a ``BoundedCaller``): a hung client costs its caller
one timeout (``StoreUnavailableError``), never a hang; the binding's own exceptions become
``StoreError``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvflow.bounded import BoundedCaller
from kvflow.errors import StoreError, StoreUnavailableError

__all__ = ["BoundedCalls"]


class BoundedCalls(BoundedCaller):
    """``call(name, fn, *args)``: ``fn(*args)`` on ``threads`` threads, waited for at most
    ``timeout_s``; ``on_timeout`` runs (on the caller's thread) before the error is raised.
    Thread-safe. A call that timed out keeps its thread until it returns."""

    def __init__(
        self,
        engine: str,
        timeout_s: float,
        on_timeout: Callable[[], None] = lambda: None,
        threads: int = 4,
    ) -> None:
        def timed_out(what: str, wait: float) -> StoreUnavailableError:
            on_timeout()
            return StoreUnavailableError(f"{what} did not return within {wait:g} s")

        super().__init__(
            engine, timeout_s, threads=threads, timeout_error=timed_out, errors=_binding_error
        )
        self.engine = engine


def _binding_error(what: str, exc: BaseException) -> StoreError | None:
    if isinstance(exc, (RuntimeError, ValueError, TypeError)):  # the binding's own errors
        return StoreError(f"{what} failed: {exc}")
    return None
