"""The copy executor: a few threads that pin themselves to chosen CPUs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvflow.bounded import BoundedCaller
from kvflow.cpus import pin_current_thread

__all__ = ["PinnedExecutor", "call_pinned"]

T = TypeVar("T")


def call_pinned(
    cpus: tuple[int, ...],
    fn: Callable[..., T],
    *args: Any,
    timeout_s: float = 300.0,
    on_late: Callable[[T], object] | None = None,
) -> T:
    """``fn(*args)`` on a new thread pinned to ``cpus``, waited for; its result or exception.

    Threads that ``fn`` starts inherit the pinning: a store whose client runs transfer threads
    of its own (Mooncake) is created this way so that they stay off the cores that compute.
    After ``timeout_s`` the caller gets TransferTimeoutError; the thread (a daemon) finishes on
    its own, and what it returns then goes to ``on_late`` (e.g. to close a store nobody took).
    Without ``cpus`` the call runs in the caller's thread, unbounded: ``fn`` bounds itself.
    """
    if not cpus:
        return fn(*args)
    calls = BoundedCaller("", timeout_s, cpus=cpus, on_late=on_late)
    try:
        return calls.call(f"{getattr(fn, '__name__', 'a call')} on CPUs {list(cpus)}", fn, *args)
    finally:
        calls.shutdown()


class PinnedExecutor:
    """A thread pool whose threads call ``os.sched_setaffinity(0, cpus)`` when they start.

    ``submit`` is thread-safe. ``in_flight`` counts submitted calls not yet finished; ``pinned``
    counts threads whose pinning succeeded (it stays 0 without ``cpus``, or off Linux).
    """

    def __init__(self, threads: int, cpus: tuple[int, ...], name: str = "kvflow-copy") -> None:
        self.threads = threads
        self.cpus = cpus
        self.pinned = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=self._pin)

    def _pin(self) -> None:
        if not pin_current_thread(self.cpus):
            return
        with self._lock:
            self.pinned += 1

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            self.in_flight += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Future[Any]) -> None:
        with self._lock:
            self.in_flight -= 1

    def shutdown(self, *, wait: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def __repr__(self) -> str:
        return (
            f"PinnedExecutor(threads={self.threads}, cpus={list(self.cpus)}, "
            f"pinned={self.pinned}, in_flight={self.in_flight})"
        )
