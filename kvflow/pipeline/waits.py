"""Waits with timeouts that never swallow a cancellation.

``asyncio.wait_for`` before Python 3.12 can return a result and drop the caller's cancellation
when both arrive together (CPython gh-86296); a task so treated runs on and may wait forever.
These helpers use ``asyncio.wait``, which always propagates CancelledError, and report a
timeout as ``False`` so that callers decide what it means.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["acquire_within", "event_within", "future_within", "get_within"]

T = TypeVar("T")


async def future_within(future: asyncio.Future[Any], timeout: float) -> bool:
    """True once ``future`` is done; False after ``timeout`` s. Never cancels ``future``."""
    if not future.done():
        await asyncio.wait((future,), timeout=timeout)
    return future.done()


async def _within(coro: Coroutine[Any, Any, T], timeout: float) -> asyncio.Task[T]:
    """Run ``coro`` as a task for at most ``timeout`` s, cancelled past that; returns the task.

    A cancellation of the caller cancels the task too (``finally``) and propagates."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.wait((task,), timeout=timeout)
    finally:
        if not task.done():
            task.cancel()
    return task


def _succeeded(task: asyncio.Task[Any]) -> bool:
    return task.done() and not task.cancelled()


async def event_within(event: asyncio.Event, timeout: float) -> bool:
    """True once ``event`` is set; False after ``timeout`` s."""
    if not event.is_set():
        await _within(event.wait(), timeout)
    return event.is_set()


async def acquire_within(semaphore: asyncio.Semaphore, timeout: float) -> bool:
    """True once ``semaphore`` is acquired; False, holding nothing, after ``timeout`` s."""
    if not semaphore.locked():
        await semaphore.acquire()  # free now: returns without suspending
        return True
    return _succeeded(await _within(semaphore.acquire(), timeout))


async def get_within(queue: asyncio.Queue[T], timeout: float) -> T | None:
    """The next item of ``queue``; None after ``timeout`` s (nothing is taken then)."""
    if not queue.empty():
        return queue.get_nowait()
    task = await _within(queue.get(), timeout)
    return task.result() if _succeeded(task) else None
