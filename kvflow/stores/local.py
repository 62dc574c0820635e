"""LocalStore: the embedded pool, a host-memory arena inside this process."""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from kvflow.config import parse_size
from kvflow.copying.cuda import pin_host
from kvflow.copying.host import NATIVE, copy_ranges
from kvflow.errors import ClosedError, ConfigError, InvalidArgumentError
from kvflow.stores.arena import SLOT_ALIGN, ArenaIndex
from kvflow.stores.base import (
    Direction,
    ReadSession,
    Store,
    StoreUsage,
    WriteSession,
    WriteStatus,
)
from kvflow.stores.hostmem import check_capacity
from kvflow.stores.regions import LocalRegions, check_copy_arrays

__all__ = ["LocalStore"]

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PAGE = mmap.PAGESIZE


class LocalStore(Store):
    """A host-memory arena of ``capacity`` bytes (``"8GiB"`` accepted) in this process.

    A capacity beyond the memory this machine (or this process's memory cgroup) has available
    is refused with ConfigError (``kvflow.stores.hostmem``). The arena is anonymous memory
    advised for huge pages. Its pages are mapped on first write, which on some machines (VMs
    with memory ballooning) costs seconds per GiB on the first saves; ``prefault=True`` pays
    that once, at construction, instead. ``native_copy=False`` uses the pure-Python copy loop
    even where the native one is built (for comparisons).

    KV caches on a CUDA GPU are copied by the GPU's DMA engines (``Store.device_memory``; see
    ``kvflow.devices.CudaDevice``). ``pin`` page-locks the arena for that (``kvflow.copying.cuda``):
    ``None`` (the default) when a CUDA GPU is present, ``True`` always (an error without one),
    ``False`` never. Pinning maps every page at construction, like ``prefault``.

    Two-phase writes, read leases and LRU eviction of committed, unleased objects, a prefix's
    tail before its head (see ``kvflow.stores.base`` for the contract and the prefix context,
    ``kvflow.stores.arena`` for the order). A save that finds no room
    is skipped and counted.

    Concurrency: every method is thread-safe. Metadata calls take one lock for a few
    microseconds per key; ``batch_copy`` takes no lock and copies without the GIL (see
    ``kvflow.copying.host``), so several copy threads run in parallel. ``close()`` aborts
    pending writes and drops leases; finishing or closing a session after ``close()`` is a
    no-op. The memory itself lives until the store object is garbage, so a straggling copy
    cannot fault. ``usage().used`` counts object bytes; each object occupies a 4 KiB-aligned
    slot.
    """

    inline_metadata = True
    device_memory = frozenset({"cpu", "cuda"})
    saves_in_memory = True

    def __init__(
        self,
        capacity: int | str = "1GiB",
        *,
        prefault: bool = False,
        native_copy: bool = NATIVE,
        pin: bool | None = None,
    ) -> None:
        size = parse_size(capacity, argument="capacity")
        if size < SLOT_ALIGN:
            raise ConfigError("capacity", capacity, f"must be at least {SLOT_ALIGN} bytes")
        if pin is not None and not isinstance(pin, bool):  # as SharedStoreConfig's pin
            raise ConfigError("pin", pin, "must be true or false, or None (when a GPU is present)")
        check_capacity(size, capacity)  # before any memory is mapped
        self._map = _anonymous_map(size, prefault=prefault)
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)
        self._base = int(self._buffer.ctypes.data)
        unpin = pin_host(self._base, size, pin)
        self.pinned = unpin is not None
        if unpin is not None:  # unpinned when the store goes, before its memory is unmapped
            weakref.finalize(self, unpin)
        self._index = ArenaIndex(size)
        self._lock = threading.Lock()
        self._regions = LocalRegions()
        self._closed = False
        self._native_copy = native_copy

    @property
    def capacity(self) -> int:
        return self._index.capacity

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._regions.register(regions)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        return self.lookup_with_context(keys, ())

    def lookup_with_context(self, keys: Sequence[str], context: Sequence[str]) -> np.ndarray:
        with self._lock:
            self._check_open()
            return self._index.lookup(keys, context)

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        return self.open_write_with_context(keys, nbytes, ())

    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession:
        keys = tuple(keys)
        with self._lock:
            self._check_open()
            handle, offsets, status = self._index.open_write(keys, nbytes, tuple(context))
        granted = status == WriteStatus.GRANTED
        return WriteSession(handle, keys, np.where(granted, offsets + self._base, 0), status)

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        ok = np.asarray(ok, dtype=bool)
        if ok.shape != (len(session.keys),):
            raise InvalidArgumentError("ok", ok.shape, f"expected {len(session.keys)} flags")
        with self._lock:
            if not self._closed:
                self._index.finish_write(session.handle, ok)

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        return self.open_read_with_context(keys, ())

    def open_read_with_context(self, keys: Sequence[str], context: Sequence[str]) -> ReadSession:
        keys = tuple(keys)
        with self._lock:
            self._check_open()
            handle, offsets, found, _ = self._index.open_read(keys, tuple(context))
        return ReadSession(handle, keys, np.where(found, offsets + self._base, 0), found)

    def close_read(self, session: ReadSession) -> None:
        with self._lock:
            if not self._closed:
                self._index.close_read(session.handle)

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        if self._closed:
            raise ClosedError("LocalStore")
        self._check_ranges(pool_addrs, local_addrs, sizes)
        if direction == Direction.TO_POOL:
            dst, src = pool_addrs, local_addrs
        elif direction == Direction.FROM_POOL:
            dst, src = local_addrs, pool_addrs
        else:
            raise InvalidArgumentError("direction", direction, "expected a Direction")
        copy_ranges(dst, src, sizes, native=self._native_copy)
        return np.zeros(0, dtype=np.int64)

    def usage(self) -> StoreUsage:
        with self._lock:
            return self._index.usage()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._index.release_all()
                self._closed = True

    def __repr__(self) -> str:
        u = self.usage()
        return (
            f"LocalStore(capacity={u.capacity}, used={u.used}, objects={u.objects}, "
            f"pinned={self.pinned}, "
            f"pending={u.pending_writes}, leases={u.leases}, closed={self._closed})"
        )

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("LocalStore")

    def _check_ranges(self, pool: np.ndarray, local: np.ndarray, sizes: np.ndarray) -> None:
        """Refuse any range outside the arena or outside registered local memory."""
        check_copy_arrays(pool, local, sizes)
        if sizes.size == 0:
            return
        lo, hi = self._base, self._base + self.capacity
        # compare sizes with the room left, never addr + size, which can wrap past 2**63
        if pool.min() < lo or pool.max() > hi or (sizes > hi - pool).any():
            raise InvalidArgumentError("pool_addrs", hex(int(pool.min())), "outside the arena")
        self._regions.check(local, sizes)


def _anonymous_map(size: int, *, prefault: bool) -> mmap.mmap:
    """Page-aligned anonymous memory, advised for huge pages, optionally populated now."""
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # advice only: kernels without THP refuse it
            mem.madvise(mmap.MADV_HUGEPAGE)
    if prefault:
        try:
            mem.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # older kernels: touch one byte per page
            np.frombuffer(mem, dtype=np.uint8)[::_PAGE] = 0
    return mem
