"""Calls on helper threads, each bounded in time; threads pinned to chosen CPUs.

Native pool clients block in C++ with no timeout of their own (some retry forever while their
service is away), and so may opening a store. ``BoundedCaller`` runs such calls on daemon
threads of its own and waits at most ``timeout_s`` for each: a hung call costs its caller one
timeout, never a hang, and never keeps the process from exiting. What the caller gets is
chosen per use: the error a timeout raises, how the call's own exceptions are translated,
what happens to a result that comes back after its caller gave up, and whether new calls are
refused while one that timed out still runs.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvflow.cpus import pin_current_thread
from kvflow.errors import ClosedError, TransferTimeoutError

__all__ = ["BoundedCaller"]

log = logging.getLogger("kvflow")

T = TypeVar("T")


@dataclass(eq=False)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    abandoned: bool = False  # the caller gave up waiting
    on_late: Callable[[Any], object] | None = None


class BoundedCaller:
    """``call(name, fn, *args)``: ``fn(*args)`` on a helper thread, waited for at most
    ``timeout_s``; its result, or what it raised (translated by ``errors``). ``call(...,
    on_late=f)``: a result that comes back after its caller gave up goes to ``f`` (on the
    helper thread), not to the ``on_late`` of all calls.

    ``what`` names the calls in errors (with each call's ``name`` after it). ``cpus``: the
    helper threads pin themselves there, and threads that ``fn`` starts inherit it. ``threads``:
    how many calls run at once; more wait for a free thread, and that wait counts against
    their time limit. After ``timeout_s`` the caller gets ``timeout_error(description,
    timeout_s)`` (default ``TransferTimeoutError``); the call keeps its thread until it returns,
    and what it returns then goes to ``on_late`` (e.g. to close a store nobody took), or is
    dropped. ``refuse_late``: while a call that timed out still runs, new calls fail at once
    with ``timeout_error("an earlier " + description, timeout_s)``: a hung service costs one
    timeout, not one per call, and never more than ``threads`` threads. ``errors`` maps what a
    call raised to the exception the caller gets (raised from it); None, or ``errors``
    answering None, re-raises it as it is.

    Thread-safe. Helper threads are daemons, started as calls need them, kept for the next
    calls until ``shutdown``.
    """

    def __init__(
        self,
        what: str,
        timeout_s: float,
        *,
        cpus: tuple[int, ...] = (),
        threads: int = 1,
        refuse_late: bool = False,
        on_late: Callable[[Any], object] | None = None,
        timeout_error: Callable[[str, float], BaseException] = TransferTimeoutError,
        errors: Callable[[str, BaseException], BaseException | None] | None = None,
    ) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.cpus = cpus
        self.threads = threads
        self._refuse_late = refuse_late
        self._on_late = on_late
        self._timeout_error = timeout_error
        self._errors = errors
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._started = 0  # helper threads alive
        self._waiting = 0  # of those, the ones waiting for a call
        self._queued = 0  # calls not yet taken by a thread
        self._late = 0  # calls that timed out and still run
        self._closed = False

    def call(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        on_late: Callable[[T], object] | None = None,
    ) -> T:
        what = " ".join(part for part in (self.what, name) if part)
        call = _Call(fn, args, on_late=on_late or self._on_late)
        with self._lock:
            if self._closed:
                raise ClosedError(what)
            if self._refuse_late and self._late:
                raise self._timeout_error(f"an earlier {what}", self.timeout_s)
            self._queued += 1
            if self._queued > self._waiting and self._started < self.threads:
                self._started += 1
                threading.Thread(
                    target=self._serve, name=_thread_name(self.what), daemon=True
                ).start()
            self._calls.put(call)
        if not call.done.wait(self.timeout_s):
            with self._lock:
                if not call.done.is_set():
                    call.abandoned = True
                    self._late += 1
            if call.abandoned:
                raise self._timeout_error(what, self.timeout_s)
        if call.error is None:
            value: T = call.value
            return value
        mapped = self._errors(what, call.error) if self._errors is not None else None
        if mapped is None:
            raise call.error
        raise mapped from call.error

    def shutdown(self) -> None:
        """Take no more calls; idle helper threads end, calls still running end theirs after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._started):
                self._calls.put(None)

    def _serve(self) -> None:
        pin_current_thread(self.cpus)
        try:
            while (call := self._next()) is not None:
                self._run(call)
        finally:
            with self._lock:
                self._started -= 1

    def _next(self) -> _Call | None:
        with self._lock:
            self._waiting += 1
        call = self._calls.get()
        with self._lock:
            self._waiting -= 1
            if call is not None:
                self._queued -= 1
        return call

    def _run(self, call: _Call) -> None:
        try:
            call.value = call.fn(*call.args)
        except BaseException as exc:  # handed to the caller
            call.error = exc
        with self._lock:
            call.done.set()
            if call.abandoned:
                self._late -= 1
        if call.abandoned and call.error is None and call.on_late is not None:
            try:
                call.on_late(call.value)
            except Exception:  # the thread serves the next calls all the same
                log.exception("kvflow: handling a late %s result", self.what)

    def __repr__(self) -> str:
        return (
            f"BoundedCaller({self.what!r}, timeout_s={self.timeout_s:g}, threads={self._started}/"
            f"{self.threads}, late={self._late}, closed={self._closed})"
        )


def _thread_name(what: str) -> str:
    return "kvflow-" + ("-".join(what.lower().split()) or "call")
