"""Timed waits report timeouts and never swallow a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.pipeline.waits import acquire_within, event_within, future_within


async def test_cancel_is_kept_when_the_future_completes_in_the_same_step() -> None:
    # the case asyncio.wait_for mishandles before Python 3.12 (CPython gh-86296)
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(future_within(fut, 10))
    await asyncio.sleep(0)
    fut.set_result(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.result() == 1  # the awaited future itself is never cancelled


async def test_future_within_times_out_without_cancelling() -> None:
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    assert await future_within(fut, 0.01) is False
    assert not fut.cancelled()


async def test_event_within() -> None:
    event = asyncio.Event()
    assert await event_within(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await event_within(event, 5) is True


async def test_acquire_within_holds_nothing_after_a_timeout() -> None:
    sem = asyncio.Semaphore(1)
    assert await acquire_within(sem, 0.01) is True
    assert await acquire_within(sem, 0.01) is False
    sem.release()
    assert await acquire_within(sem, 0.01) is True  # the timed-out waiter took no slot
    assert sem.locked()
