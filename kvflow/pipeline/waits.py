"""Waits with timeouts that never swallow a cancellation.

``asyncio.wait_for`` before Python 3.12 can return a result and drop the caller's cancellation
when both arrive together (CPython gh-86296); a task so treated runs on and may wait forever.
These helpers use ``asyncio.wait``, which always propagates CancelledError, and report a
timeout as ``False`` so that callers decide what it means.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

__all__ = ["acquire_within", "event_within", "future_within", "get_within"]

T = TypeVar("T")


async def future_within(future: asyncio.Future[Any], timeout: float) -> bool:
    """True once ``future`` is done; False after ``timeout`` s. Never cancels ``future``."""
    if not future.done():
        await asyncio.wait((future,), timeout=timeout)
    return future.done()


async def event_within(event: asyncio.Event, timeout: float) -> bool:
    """True once ``event`` is set; False after ``timeout`` s."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


async def acquire_within(semaphore: asyncio.Semaphore, timeout: float) -> bool:
    """True once ``semaphore`` is acquired; False, holding nothing, after ``timeout`` s."""
    if not semaphore.locked():
        await semaphore.acquire()  # free now: returns without suspending
        return True
    waiter = asyncio.ensure_future(semaphore.acquire())
    try:
        await asyncio.wait((waiter,), timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()
    return waiter.done() and not waiter.cancelled()


async def get_within(queue: asyncio.Queue[T], timeout: float) -> T | None:
    """The next item of ``queue``; None after ``timeout`` s (nothing is taken then)."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait((getter,), timeout=timeout)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    return None
