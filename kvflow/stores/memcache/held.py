"""The GVA ranges a MemcacheStore holds, per open session (no client and no lock of their own).

Memcache's pool is one address space shared by every process, so a copy to an object this
store is not writing, or from one it holds no lease on, could tear another's bytes. Each open
session holds its objects' ranges: a write session those of its granted keys (no deadline),
a read session those of its found keys until its lease's deadline (``lease_deadline``: a
share of ``read_lease_ttl_ms`` before memcache's own). ``HeldRanges.check`` answers, per
range of a ``batch_copy``, whether it is still held, and refuses one inside no object the
store holds at all.

Concurrency: not thread-safe; the store's ``_lock`` guards it. The clock is the caller's
(``now``), so a check is arithmetic over arrays, tested without a store.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvflow.errors import InvalidArgumentError
from kvflow.stores.regions import HeldSpans

__all__ = ["LEASE_MARGIN", "HeldRanges", "Session", "lease_deadline"]

LEASE_MARGIN = 0.1  # a read lease counts as lost this share of its time before memcache's


def lease_deadline(started: float, ttl_ms: int) -> float:
    """When a read lease taken at ``started`` (monotonic) stops counting here."""
    return started + ttl_ms / 1000 * (1 - LEASE_MARGIN)


@dataclass(eq=False)
class Session:
    """An open session of a MemcacheStore."""

    keys: tuple[str, ...]
    held: np.ndarray  # positions of the granted (write) or found (read) keys
    writing: bool

    @property
    def objects(self) -> int:
        return int(self.held.size)


class HeldRanges:
    """The ranges of the open sessions' objects, write and read apart, by session handle."""

    def __init__(self) -> None:
        self._write = HeldSpans()
        self._read = HeldSpans()

    def add(
        self, handle: int, writing: bool, starts: np.ndarray, ends: np.ndarray, deadline: float
    ) -> None:
        """A session's objects ``[starts[i], ends[i])``, held until ``deadline`` (monotonic)."""
        (self._write if writing else self._read).add(handle, starts, ends, deadline, None)

    def remove(self, handle: int, writing: bool) -> None:
        (self._write if writing else self._read).remove(handle)

    def clear(self) -> None:
        self._write, self._read = HeldSpans(), HeldSpans()

    def check(
        self, pool: np.ndarray, sizes: np.ndarray, reading: bool, now: float, *, strict: bool
    ) -> np.ndarray:
        """Per range: inside an object this store writes (or, reading, holds under a lease
        live at ``now``). ``strict``: a range inside no object this store holds at all is
        refused (InvalidArgumentError)."""
        live: np.ndarray = self._write.cover(pool, sizes, None)[0]
        inside = live
        if reading:
            inside = live | self._read.cover(pool, sizes, None)[0]
            live = live | self._read.cover(pool, sizes, now)[0]
        if strict and not inside.all():
            bad = hex(int(pool[~inside][0]))
            what = "holds under a read lease" if reading else "is writing"
            raise InvalidArgumentError("pool_addrs", bad, f"not inside an object this store {what}")
        return live
