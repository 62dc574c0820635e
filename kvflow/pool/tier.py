"""DiskTier: the pool server's disk tier under its DRAM arena (``kvflow.pool.disk`` objects).

Chunks reach disk by write-through, off every client's call: each commit queues its keys, and
the writer thread copies each object from the arena into its file (holding it meanwhile:
``ArenaIndex.hold``, so its slot is not reused under the copy, and its place in DRAM's eviction
order is left as the clients made it). DRAM then evicts as it always did; what
it evicts is on disk already. Why write-through rather than writing what DRAM evicts: a write
at eviction would have to copy the object inside the client's save that evicts it (or hold
its slot and fail that save for room), and the disk would hold only what DRAM lost, so a
restart (or ``kill -9``) would lose the hottest chunks; docs/benchmarks.md has the figures.
A commit that arrives while ``queue_bytes`` are queued is not written (counted:
``demotions_skipped``), nor is one DRAM evicted before its turn.

A lookup sees both tiers (for the connections that read disk files: ``kvflow.pool.service``).
A chunk on disk only is loaded per ``disk_reads``:

* ``layerwise``: the client reads it from the file itself, layer by layer into its destination
  while earlier layers compute (``kvflow.pool.diskread``); once the read session ends, the
  promoter thread copies the chunk into DRAM (from the page cache, as a rule), so the next hit
  is a DRAM hit;
* ``promote``: the server copies it into DRAM before answering the read (``promote``).

Disk eviction keeps the DRAM tier's order: lookups and reads touch their keys on disk too,
last to first, so a prefix's tail is evicted before its head.

Locks: the service's lock guards the arena index; calls marked so are made under it. The
tier's own condition guards its queues, taken under the service's lock or alone, never the
other way round; disk I/O runs under neither.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from kvflow.pool.disk import DiskObjects
from kvflow.pool.diskfiles import granules
from kvflow.stores.arena import ArenaIndex
from kvflow.stores.base import WriteStatus

__all__ = ["DiskTier"]

log = logging.getLogger("kvflow.pool")

T = TypeVar("T")
_STOP_WAIT_S = 10.0  # close(): how long to wait for a copy under way


class DiskTier:
    """The disk tier ``disk`` under the arena at address ``arena`` whose index is ``index``,
    guarded by ``lock`` (the service's). ``reads``: ``layerwise`` or ``promote``."""

    def __init__(
        self,
        disk: DiskObjects,
        index: ArenaIndex,
        lock: threading.Lock,
        arena: int,
        *,
        reads: str = "layerwise",
        queue_bytes: int = 1 << 30,
    ) -> None:
        self.disk = disk
        self.reads = reads
        self._index = index
        self._lock = lock
        self._arena = arena
        self._queue_bytes = queue_bytes
        self._cond = threading.Condition()
        self._down: deque[tuple[str, int]] = deque()  # (key, size): to write
        self._up: deque[str] = deque()  # to promote
        self._queued = 0  # bytes in _down
        self._pending = 0  # objects queued or being copied, either way
        self._promoting: set[str] = set()
        self._after: dict[int, list[str]] = {}  # read session -> disk keys to promote at its end
        self._closed = False
        self.counts = dict.fromkeys(
            (
                "disk_hits",
                "disk_reads_served",
                "demotions",
                "demotion_bytes",
                "demotions_skipped",
                "promotions",
                "promotion_bytes",
                "promotions_failed",
                "disk_dropped_by_clients",
            ),
            0,
        )
        self._threads = [
            threading.Thread(target=self._write_loop, name="kvflow-disk-write", daemon=True),
            threading.Thread(target=self._promote_loop, name="kvflow-disk-promote", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- under the service's lock -------------------------------------------------------------

    def lookup(
        self, keys: Sequence[str], in_dram: np.ndarray, context: Sequence[str], *, hits: bool
    ) -> np.ndarray:
        """Which of ``keys`` not in DRAM (``in_dram``) the disk holds; every key found in
        either tier is touched on disk, then ``context``, last to first; ``hits``: count
        those found as disk hits. Holds the lock."""
        on_disk: np.ndarray = self.disk.lookup(keys) & ~in_dram
        self.disk.touch(context)
        if hits:
            self.counts["disk_hits"] += int(on_disk.sum())
        return on_disk

    def sizes(self, keys: Sequence[str]) -> np.ndarray:
        """Payload sizes on disk (0: not there). Holds the lock."""
        sizes: np.ndarray = self.disk.sizes(keys)
        return sizes

    def committed(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Objects just committed in DRAM: queue them for disk, last to first (so a prefix's
        head is written last: the newest on disk). Holds the lock."""
        with self._cond:
            for key, size in zip(reversed(keys), reversed(sizes), strict=True):
                if self._queued + size > self._queue_bytes:
                    self.counts["demotions_skipped"] += 1
                    continue
                self._down.append((key, size))
                self._queued += size
                self._pending += 1
            self._cond.notify_all()

    def served(self, handle: int, keys: Sequence[str]) -> None:
        """Keys read session ``handle`` reads from disk: promoted into DRAM in the background
        once it ends (``ended``), when their pages are fresh in the page cache and no longer
        contend with the client's own reads. Holds the lock."""
        self.counts["disk_reads_served"] += len(keys)
        self._after[handle] = list(keys)

    def ended(self, handle: int) -> None:
        """Read session ``handle`` ended (closed, expired, its client gone). Holds the lock."""
        keys = self._after.pop(handle, None)
        if not keys:
            return
        with self._cond:
            new = [k for k in dict.fromkeys(keys) if k not in self._promoting]
            self._up.extend(new)
            self._promoting.update(new)
            self._pending += len(new)
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        d = self.disk.stats()
        values = dict(self.counts)
        with self._cond:
            values["disk_queued"] = self._pending
        values.update(
            disk_capacity=d.capacity,
            disk_used=d.bytes,
            disk_objects=d.objects,
            disk_evictions=d.evictions,
            disk_io_errors=d.io_errors,
            disk_no_space=d.no_space,
            disk_corrupt=d.corrupt,
            disk_recovered=d.recovered,
        )
        return values

    # -- without the lock -----------------------------------------------------------------------

    def promote(self, keys: Sequence[str]) -> None:
        """Copy the disk objects of ``keys`` into DRAM now, those DRAM lacks (``promote``
        reads: the caller's answer waits for this). Takes the lock for the index only."""
        for key in keys:
            self._promote(key)

    def drop(self, keys: Sequence[str]) -> None:
        """A client found these objects bad: delete them."""
        dropped = sum(self.disk.remove(key) for key in keys)
        with self._lock:
            self.counts["disk_dropped_by_clients"] += dropped

    def close(self) -> None:
        """Stop the threads (a copy under way finishes) and close the disk objects."""
        with self._cond:
            self._closed = True
            self._down.clear()
            self._up.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(_STOP_WAIT_S)
        self.disk.close()

    def __repr__(self) -> str:
        with self._cond:
            down, up, pending = len(self._down), len(self._up), self._pending
        return (
            f"DiskTier({self.disk.directory!r}, reads={self.reads!r}, to_write={down}, "
            f"to_promote={up}, under_way={pending - down - up}, closed={self._closed})"
        )

    # -- the threads ----------------------------------------------------------------------------

    def _next(self, queue: deque[T]) -> T | None:
        with self._cond:
            while not queue and not self._closed:
                self._cond.wait()
            return None if self._closed else queue.popleft()

    def _write_loop(self) -> None:
        while (item := self._next(self._down)) is not None:
            key, size = item
            with self._cond:
                self._queued -= size
            try:
                self._write(key)
            except Exception:  # never let the thread die: the tier would stop silently
                log.exception("disk tier: writing %r failed", key)
            finally:
                with self._cond:
                    self._pending -= 1

    def _write(self, key: str) -> None:
        if self.disk.sizes([key])[0]:  # on disk already (saved again): newest there too
            self.disk.touch([key])
            return
        with self._lock:  # held, not leased: DRAM's eviction order stays the clients'
            held = self._index.hold(key)
            if held is None:
                self.counts["demotions_skipped"] += 1
                return
        offset, size = held
        try:
            ok = self.disk.put(key, self._view(offset, size), granules(size))
        finally:
            with self._lock:
                self._index.release(key)
        if ok:
            with self._lock:
                self.counts["demotions"] += 1
                self.counts["demotion_bytes"] += size

    def _promote_loop(self) -> None:
        while (key := self._next(self._up)) is not None:
            try:
                self._promote(key)
            except Exception:
                log.exception("disk tier: promoting %r failed", key)
            finally:
                with self._cond:
                    self._promoting.discard(key)
                    self._pending -= 1

    def _promote(self, key: str) -> bool:
        size = int(self.disk.sizes([key])[0])
        with self._lock:
            if not size or self._index.holds(key):
                return False
            handle, offsets, status = self._index.open_write([key], size)
            if status[0] != WriteStatus.GRANTED:
                self._index.finish_write(handle, np.zeros(1, dtype=bool))
                self.counts["promotions_failed"] += 1
                return False
        ok = False
        try:
            ok = self.disk.read(key, 0, size, self._view(int(offsets[0]), size))
        finally:
            with self._lock:
                self._index.finish_write(handle, np.array([ok]))
                self.counts["promotions" if ok else "promotions_failed"] += 1
                self.counts["promotion_bytes"] += size if ok else 0
        return ok

    def _view(self, offset: int, size: int) -> memoryview:
        """The arena's bytes ``[offset, offset + size)``."""
        return memoryview((ctypes.c_char * size).from_address(self._arena + offset)).cast("B")
