"""The bookkeeping of a slot arena: slots, two-phase writes, leases, tail-first LRU eviction.

``ArenaIndex`` knows nothing about where the arena's bytes live; it hands out offsets. The
embedded LocalStore wraps it around a host buffer, and a store that keeps the arena elsewhere can
reuse it unchanged. Not thread-safe: the owner serialises calls.

Slots are fixed-size per object size: the first object of a size carves slots of that size from
the free space, and freed slots are reused for objects of the same size. One layout means one
object size, so a pool serving one model never fragments.

Eviction takes the least recently used committed, unleased object of the slot size needed, and
every call touches its keys last to first. Chunk keys are prefix-chained: a chunk is of use only
while every chunk before it is stored, and callers name a prompt's chunks in prefix order. So
within a call the head ends up more recently used than the tail, and eviction takes a prefix's
tail before its head instead of leaving a tail that no lookup reaches. The touches:

* ``lookup`` and ``open_read`` (whose leases go back into the order at ``close_read``, last to
  first): every key found;
* ``open_write``: the keys that exist, before anything is allocated; an allocation never evicts
  a key of its own call (a prompt's head is not evicted to store its tail: ``NO_SPACE``);
* ``finish_write``: all of ``open_write``'s keys, last to first, the new ones committed and the
  existing ones touched again, so extending a prefix leaves its head, not its new tail, the most
  recently used.

A caller that moves only a prefix's later chunks (a save of just the new chunks, a load after
the chunks an inference server's own cache holds) names the chunks before them as ``context``
(the prefix context of ``kvflow.stores.base``): keys never granted, written or leased, touched
(where committed and unleased) after the call's own keys, last to first, when ``lookup``,
``open_write`` and ``open_read`` run and again at ``finish_write`` and ``close_read``. The head
then ends up newer than the tail it leads to, and ``open_write`` spares the context as it spares
its own keys.
Without context such a call orders its own keys among themselves only; the chunks it does not
name keep their place.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
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
    held: int = 0  # ``hold``s: never evicted meanwhile, its place in the LRU kept


@dataclass
class _Session:
    writing: bool
    keys: list[str] = field(default_factory=list)  # leased (read) or granted (write) keys
    positions: list[int] = field(default_factory=list)  # index of each key in open_write's keys
    named: Sequence[str] = ()  # a write's keys as open_write got them, touched again at commit
    context: Sequence[str] = ()  # the chunks before the keys: touched last, at the end too


class ArenaIndex:
    """Index of a ``capacity``-byte arena. Offsets returned are relative to the arena's start."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[str, _Entry] = {}
        # committed, unleased objects (evictable), oldest first, one LRU per slot size: finding
        # a victim of the size needed is O(1) whatever else the arena holds. Calls touch their
        # keys last to first (see the module's docstring)
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

    def lookup(self, keys: Sequence[str], context: Sequence[str] = ()) -> np.ndarray:
        """Which keys are committed; touches those found, then ``context``'s (not counted)."""
        found = np.zeros(len(keys), dtype=bool)
        for i in range(len(keys) - 1, -1, -1):  # last to first: a prefix's head ends up newest
            entry = self._entries.get(keys[i])
            if entry is not None and entry.committed:
                found[i] = True
                if entry.leases == 0:
                    self._lru_of(entry).move_to_end(keys[i])
        self._touch_all(context)
        hits = int(found.sum())
        self.hits += hits
        self.misses += len(keys) - hits
        return found

    def holds(self, key: str) -> bool:
        """Whether ``key`` is stored or being written; not counted, not touched."""
        return key in self._entries

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

    def open_write(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str] = ()
    ) -> tuple[int, np.ndarray, np.ndarray]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
            raise InvalidArgumentError("nbytes", nbytes, "must be an integer >= 1")
        offsets = np.zeros(len(keys), dtype=np.int64)
        status = np.full(len(keys), WriteStatus.EXISTS, dtype=np.int8)
        session = _Session(writing=True, named=tuple(keys), context=tuple(context))
        touched = {key for key in reversed(session.named) if self._touch(key)}
        touched.update(key for key in reversed(session.context) if self._touch(key))
        for i, key in enumerate(session.named):
            if key in self._entries:
                continue
            offset = self._allocate(nbytes, spare=touched)
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

    def finish_write(self, handle: int, ok: np.ndarray) -> list[tuple[str, int]]:
        """Commit the granted keys whose flag (at the key's position in ``open_write``) is set;
        abort the others. An empty ``ok`` aborts everything. Every key of ``open_write`` is
        touched, last to first: the committed ones join the LRU, the existing ones move up; then
        its context, last to first. Returns the keys committed, with their sizes, in order."""
        session = self._close(handle, writing=True)
        committed: list[tuple[str, int]] = []
        granted = len(session.keys) - 1
        for pos in range(len(session.named) - 1, -1, -1):
            if granted < 0 or session.positions[granted] != pos:
                self._touch(session.named[pos])
                continue
            key = session.keys[granted]
            granted -= 1
            entry = self._entries[key]
            if pos < len(ok) and ok[pos]:
                entry.committed = True
                self._objects += 1
                self._lru_of(entry)[key] = None
                committed.append((key, entry.size))
            else:
                self._drop(key)
        self._touch_all(session.context)
        committed.reverse()
        return committed

    # -- reads --------------------------------------------------------------------------------

    def open_read(
        self, keys: Sequence[str], context: Sequence[str] = ()
    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Lease the committed keys: (handle, offsets, found, object sizes). Touches
        ``context``, now and at ``close_read``."""
        offsets = np.zeros(len(keys), dtype=np.int64)
        sizes = np.zeros(len(keys), dtype=np.int64)
        found = np.zeros(len(keys), dtype=bool)
        session = _Session(writing=False, context=tuple(context))
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
        self._touch_all(session.context)
        return self._open(session), offsets, found, sizes

    def close_read(self, handle: int) -> None:
        """Release the session's leases; objects no longer leased rejoin the LRU, last to
        first, then its context is touched, last to first."""
        session = self._close(handle, writing=False)
        for key in reversed(session.keys):
            entry = self._entries[key]
            entry.leases -= 1
            self._leases -= 1
            if entry.leases == 0:
                self._lru_of(entry)[key] = None
        self._touch_all(session.context)

    def hold(self, key: str) -> tuple[int, int] | None:
        """Keep the committed ``key`` from eviction, leaving its place in the eviction order
        (a lease takes it out and puts it back newest): (offset, size), or None if ``key`` is
        not committed. For an owner that reads objects in the background (the disk tier's
        writer), so that the order stays the one its clients made. ``release`` ends it."""
        entry = self._entries.get(key)
        if entry is None or not entry.committed:
            return None
        entry.held += 1
        return entry.offset, entry.size

    def release(self, key: str) -> None:
        """End one ``hold`` of ``key``."""
        self._entries[key].held -= 1

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

    def _touch(self, key: str) -> bool:
        """Make ``key`` the most recently used if it is committed and unleased."""
        entry = self._entries.get(key)
        if entry is None or not entry.committed or entry.leases:
            return False
        self._lru_of(entry).move_to_end(key)
        return True

    def _touch_all(self, keys: Sequence[str]) -> None:
        """Touch ``keys`` last to first (a context: the chunks before a call's keys)."""
        for key in reversed(keys):
            self._touch(key)

    def _allocate(self, nbytes: int, spare: Container[str]) -> int | None:
        """A slot for ``nbytes``: a freed one, new space, or the least recently used object's,
        unless that is in ``spare`` (the keys the calling ``open_write`` touched: they are the
        newest, so only they are left)."""
        slot = slot_bytes(nbytes)
        free = self._free.get(slot)
        if free:
            return free.pop()
        if self._bump + slot <= self.capacity:
            offset = self._bump
            self._bump += slot
            return offset
        lru = self._lru.get(slot)
        key = next((k for k in lru if not self._entries[k].held), None) if lru else None
        if lru and key is not None and key not in spare:  # the least recently used not held
            del lru[key]
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
