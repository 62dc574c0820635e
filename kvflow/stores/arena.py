"""The bookkeeping of a slot arena: slots, two-phase writes, leases, LRU eviction.

``ArenaIndex`` knows nothing about where the arena's bytes live; it hands out offsets. The
embedded LocalStore wraps it around a host buffer, and a store that keeps the arena elsewhere can
reuse it unchanged. Not thread-safe: the owner serialises calls.

Slots are fixed-size per object size: the first object of a size carves slots of that size from
the free space, and freed slots are reused for objects of the same size. One layout means one
object size, so a pool serving one model never fragments.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvflow.errors import InvalidArgumentError
from kvflow.stores.base import StoreUsage, WriteStatus

__all__ = ["ArenaIndex", "SLOT_ALIGN", "slot_bytes"]

SLOT_ALIGN = 4096


def slot_bytes(nbytes: int) -> int:
    """The arena space an object of ``nbytes`` occupies (rounded up to SLOT_ALIGN)."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


@dataclass
class _Entry:
    offset: int
    size: int
    committed: bool = False
    leases: int = 0


@dataclass
class _Session:
    writing: bool
    keys: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # index of each key in open_write's keys


class ArenaIndex:
    """Index of a ``capacity``-byte arena. Offsets returned are relative to the arena's start."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[str, _Entry] = {}
        # committed, unleased objects (evictable), oldest first, one LRU per slot size: finding
        # a victim of the size needed is O(1) whatever else the arena holds
        self._lru: dict[int, OrderedDict[str, None]] = {}
        self._free: dict[int, list[int]] = {}
        self._bump = 0
        self._sessions: dict[int, _Session] = {}
        self._next_handle = 1
        self._used = 0
        self._objects = 0  # committed entries (usage() must not walk the index under the lock)
        self._leases = 0
        self.hits = self.misses = self.evictions = self.no_space = 0

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is not None and entry.committed:
                found[i] = True
                if entry.leases == 0:
                    self._lru_of(entry).move_to_end(key)
        hits = int(found.sum())
        self.hits += hits
        self.misses += len(keys) - hits
        return found

    def usage(self) -> StoreUsage:
        committed = self._objects
        return StoreUsage(
            capacity=self.capacity,
            used=self._used,
            objects=committed,
            pending_writes=len(self._entries) - committed,
            leases=self._leases,
            open_sessions=len(self._sessions),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            no_space=self.no_space,
        )

    # -- writes -------------------------------------------------------------------------------

    def open_write(self, keys: Sequence[str], nbytes: int) -> tuple[int, np.ndarray, np.ndarray]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
            raise InvalidArgumentError("nbytes", nbytes, "must be an integer >= 1")
        offsets = np.zeros(len(keys), dtype=np.int64)
        status = np.full(len(keys), WriteStatus.EXISTS, dtype=np.int8)
        session = _Session(writing=True)
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is not None:
                if entry.committed and entry.leases == 0:
                    self._lru_of(entry).move_to_end(key)
                continue
            offset = self._allocate(nbytes)
            if offset is None:
                status[i] = WriteStatus.NO_SPACE
                self.no_space += 1
                continue
            self._entries[key] = _Entry(offset=offset, size=nbytes)
            self._used += nbytes
            session.keys.append(key)
            session.positions.append(i)
            offsets[i] = offset
            status[i] = WriteStatus.GRANTED
        return self._open(session), offsets, status

    def finish_write(self, handle: int, ok: np.ndarray) -> None:
        """Commit the granted keys whose flag (at the key's position in ``open_write``) is set;
        abort the others. An empty ``ok`` aborts everything."""
        session = self._close(handle, writing=True)
        for key, pos in zip(session.keys, session.positions, strict=True):
            entry = self._entries[key]
            if pos < len(ok) and ok[pos]:
                entry.committed = True
                self._objects += 1
                self._lru_of(entry)[key] = None
            else:
                self._drop(key)

    # -- reads --------------------------------------------------------------------------------

    def open_read(self, keys: Sequence[str]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Lease the committed keys: (handle, offsets, found, object sizes)."""
        offsets = np.zeros(len(keys), dtype=np.int64)
        sizes = np.zeros(len(keys), dtype=np.int64)
        found = np.zeros(len(keys), dtype=bool)
        session = _Session(writing=False)
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or not entry.committed:
                continue
            entry.leases += 1
            self._leases += 1
            self._lru_of(entry).pop(key, None)
            session.keys.append(key)
            offsets[i] = entry.offset
            sizes[i] = entry.size
            found[i] = True
        return self._open(session), offsets, found, sizes

    def close_read(self, handle: int) -> None:
        for key in self._close(handle, writing=False).keys:
            entry = self._entries[key]
            entry.leases -= 1
            self._leases -= 1
            if entry.leases == 0:
                self._lru_of(entry)[key] = None

    def release_all(self) -> None:
        """Abort every pending write and release every lease (the owner is going away)."""
        for handle, session in list(self._sessions.items()):
            if session.writing:
                self.finish_write(handle, np.zeros(0, dtype=bool))
            else:
                self.close_read(handle)

    # -- internals ----------------------------------------------------------------------------

    def _open(self, session: _Session) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self._sessions[handle] = session
        return handle

    def _close(self, handle: int, *, writing: bool) -> _Session:
        session = self._sessions.get(handle)
        if session is None or session.writing != writing:
            raise InvalidArgumentError("session", handle, "unknown or already finished session")
        del self._sessions[handle]
        return session

    def _allocate(self, nbytes: int) -> int | None:
        slot = slot_bytes(nbytes)
        free = self._free.get(slot)
        if free:
            return free.pop()
        if self._bump + slot <= self.capacity:
            offset = self._bump
            self._bump += slot
            return offset
        lru = self._lru.get(slot)
        if lru:  # the least recently used object of this slot size
            key, _ = lru.popitem(last=False)
            entry = self._entries.pop(key)
            self._used -= entry.size
            self._objects -= 1
            self.evictions += 1
            return entry.offset
        return None

    def _lru_of(self, entry: _Entry) -> OrderedDict[str, None]:
        slot = slot_bytes(entry.size)
        lru = self._lru.get(slot)
        if lru is None:
            lru = self._lru[slot] = OrderedDict()
        return lru

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._lru_of(entry).pop(key, None)
        self._used -= entry.size
        slot = slot_bytes(entry.size)
        self._free.setdefault(slot, []).append(entry.offset)
