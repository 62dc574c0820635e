"""The copy executor: a few threads that pin themselves to chosen CPUs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvflow.errors import TransferTimeoutError

__all__ = ["PinnedExecutor", "call_pinned", "pin_current_thread"]

T = TypeVar("T")


def pin_current_thread(cpus: tuple[int, ...]) -> bool:
    """Pin the calling thread to ``cpus``; False when there are none or the OS refuses."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread on Linux
    except OSError:  # pinning is an optimisation, not a requirement
        return False
    return True


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
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        pin_current_thread(cpus)
        try:
            value = fn(*args)
        except BaseException as exc:  # re-raised in the caller
            with lock:
                box["error"] = exc
            return
        with lock:
            late = box.get("abandoned", False)
            box["value"] = value
        if late and on_late is not None:
            on_late(value)

    thread = threading.Thread(target=run, name="kvflow-pinned-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        if "value" not in box and "error" not in box:
            box["abandoned"] = True
            what = f"{getattr(fn, '__name__', 'a call')} on CPUs {list(cpus)}"
            raise TransferTimeoutError(what, timeout_s)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


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
