"""Objects in a store, written and read through the store interface alone: deterministic
contents per key, registered host buffers with unregistered guards either side, usage and
pool-state snapshots that every store can report."""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Sequence

import numpy as np

from kvflow.abc import Direction, Store, StoreUsage, WriteStatus
from tests.support.pools import reported_usage

__all__ = [
    "GUARD",
    "OBJ_BYTES",
    "SMALL_CAPACITY",
    "SMALL_OBJECTS",
    "STORE_CAPACITY",
    "PoolState",
    "addr",
    "alloc_registered",
    "assert_unchanged",
    "assert_usage",
    "content",
    "pool_state",
    "read_objects",
    "usage",
    "write_objects",
]

STORE_CAPACITY = 16 << 20  # the `store` fixture
OBJ_BYTES = 8192  # object size the tests use: a whole number of 4 KiB slots
SMALL_OBJECTS = 4  # the `small_store` fixture holds exactly this many OBJ_BYTES objects
SMALL_CAPACITY = SMALL_OBJECTS * OBJ_BYTES
GUARD = 4096  # unregistered bytes on either side of every buffer alloc_registered returns


def alloc_registered(store: Store, nbytes: int, *, fill: int | None = None) -> np.ndarray:
    """A host buffer of ``nbytes`` (uint8) registered with ``store``.

    The buffer is the middle of a larger allocation: the GUARD bytes either side are never
    registered, so ``addr(buf) - 1`` and ``addr(buf) + nbytes`` are known to lie outside
    registered memory. The allocation lives as long as the store: registered memory must not be
    freed and handed out again while still registered (Mooncake refuses a registration that
    overlaps an earlier one).
    """
    whole = np.zeros(nbytes + 2 * GUARD, dtype=np.uint8)
    buf = whole[GUARD : GUARD + nbytes]
    if fill is not None:
        buf[:] = fill
    store.register([(addr(buf), nbytes)])
    _KEPT.setdefault(store, []).append(whole)
    return buf


_KEPT: weakref.WeakKeyDictionary[Store, list[np.ndarray]] = weakref.WeakKeyDictionary()


def content(key: str, size: int = OBJ_BYTES) -> np.ndarray:
    """The bytes the suite stores under ``key``: a deterministic function of the key."""
    return np.frombuffer(hashlib.shake_256(key.encode()).digest(size), dtype=np.uint8)


def addr(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


def usage(store: Store) -> StoreUsage:
    """The store's occupancy, for ``arena`` tests; other tests use assert_usage or pool_state."""
    u = store.usage()
    assert u is not None, (
        f"{type(store).__name__} reports no usage(): mark the test arena, or use assert_usage"
    )
    return u


def assert_usage(store: Store, **expected: int | range) -> None:
    """Check StoreUsage fields by name: an int must match, a range must hold the value.

    pending_writes, leases and open_sessions are checked on every store; the other fields
    (occupancy and counters) only where the store reports usage().
    """
    unknown = set(expected) - {f.name for f in dataclasses.fields(StoreUsage)}
    assert not unknown, f"not StoreUsage fields: {sorted(unknown)}"
    reported = reported_usage(store)
    wrong = {
        name: {"got": reported[name], "expected": want}
        for name, want in expected.items()
        if name in reported
        and (reported[name] not in want if isinstance(want, range) else reported[name] != want)
    }
    assert not wrong, f"{type(store).__name__} usage: {wrong}"


@dataclasses.dataclass(frozen=True)
class PoolState:
    """What every store shows of a pool: which of ``keys`` are committed, and every StoreUsage
    field it reports (all of usage() where supported, else its session counts)."""

    keys: tuple[str, ...]
    found: tuple[bool, ...]
    reported: dict[str, int]


def pool_state(store: Store, keys: Sequence[str] = ()) -> PoolState:
    """The pool's state as far as ``keys`` and the store's reports show it (read after the
    lookup, which counts hits and misses)."""
    found = tuple(store.lookup(keys).tolist()) if keys else ()
    return PoolState(tuple(keys), found, reported_usage(store))


def assert_unchanged(store: Store, before: PoolState) -> None:
    """The pool is as ``before`` saw it: the reports are read before looking the keys up
    again, so the two snapshots' own lookups do not tell them apart. Once per ``before``: this
    lookup counts too."""
    reported = reported_usage(store)
    found = tuple(store.lookup(before.keys).tolist()) if before.keys else ()
    assert PoolState(before.keys, found, reported) == before


def _i64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def write_objects(
    store: Store,
    contents: dict[str, np.ndarray],
    *,
    staging: np.ndarray | None = None,
) -> np.ndarray:
    """Write and commit each key with its bytes (all the same size); returns the write status.

    ``staging`` is a registered buffer of at least ``len(contents) * size`` bytes (allocated and
    registered here when omitted).
    """
    keys = list(contents)
    size = len(contents[keys[0]])
    if staging is None:
        staging = alloc_registered(store, len(keys) * size)
    session = store.open_write(keys, size)
    granted = np.flatnonzero(session.status == WriteStatus.GRANTED)
    for j, i in enumerate(granted):
        staging[j * size : (j + 1) * size] = contents[keys[i]]
    if granted.size:
        local = [addr(staging) + j * size for j in range(granted.size)]
        failed = store.batch_copy(
            _i64(session.addrs[granted]),
            _i64(local),
            _i64([size] * granted.size),
            Direction.TO_POOL,
        )
        assert failed.size == 0
    store.finish_write(session, np.ones(len(keys), dtype=bool))
    status: np.ndarray = session.status
    return status


def read_objects(store: Store, keys: Sequence[str], size: int) -> dict[str, np.ndarray | None]:
    """Read each key's ``size`` bytes through open_read (None where not found)."""
    dst = alloc_registered(store, len(keys) * size)
    session = store.open_read(keys)
    try:
        found = np.flatnonzero(session.found)
        if found.size:
            failed = store.batch_copy(
                _i64(session.addrs[found]),
                _i64([addr(dst) + int(i) * size for i in found]),
                _i64([size] * found.size),
                Direction.FROM_POOL,
            )
            assert failed.size == 0
    finally:
        store.close_read(session)
    return {
        key: dst[i * size : (i + 1) * size].copy() if session.found[i] else None
        for i, key in enumerate(keys)
    }
