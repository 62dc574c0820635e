"""Bounded polls: wait for a condition another thread or process brings about, failing with
what was awaited once the deadline passes. Tests give deadlines far above a stall of a loaded
2-core machine: the condition usually holds within milliseconds, the deadline only bounds a hang."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for_stats", "wait_until", "wait_until_async"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01
) -> T:
    """``wait_until`` on an event loop: sleeps between polls let the loop's own tasks run."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def wait_for_stats(
    read: Callable[[], dict[str, int]],
    done: Callable[[dict[str, int]], bool],
    timeout: float,
    what: str,
) -> dict[str, int]:
    """Poll a server's counters (``read()``) until ``done(stats)``; returns those stats."""
    seen: list[dict[str, int]] = []

    def check() -> bool:
        seen[:] = [read()]
        return done(seen[0])

    wait_until(check, timeout, what)
    return seen[0]
