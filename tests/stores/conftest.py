"""Fixtures for the store contract suite: every store in ``tests.pools.STORE_FACTORIES`` runs
every test (add a pool engine there)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvflow import Direction, Store, StoreUsage, SupportsUsage, WriteStatus
from tests.pools import STORE_FACTORIES, dispose, make_store

__all__ = [
    "GUARD",
    "OBJ_BYTES",
    "SMALL_OBJECTS",
    "STORE_CAPACITY",
    "STORE_FACTORIES",
    "addr",
    "alloc_registered",
    "content",
    "make_store",
    "read_objects",
    "usage",
    "write_objects",
]

STORE_CAPACITY = 16 << 20  # the `store` fixture
OBJ_BYTES = 8192  # object size the tests use: a whole number of 4 KiB slots
SMALL_OBJECTS = 4  # the `small_store` fixture holds exactly this many OBJ_BYTES objects
GUARD = 4096  # unregistered bytes on either side of every buffer alloc_registered returns


@pytest.fixture
def store(store_name: str) -> Iterator[Store]:
    """A store of STORE_CAPACITY bytes, closed after the test."""
    s = make_store(store_name, STORE_CAPACITY)
    yield s
    dispose(s)


@pytest.fixture
def small_store(store_name: str) -> Iterator[Store]:
    """A store with room for exactly SMALL_OBJECTS objects of OBJ_BYTES: for eviction tests."""
    s = make_store(store_name, SMALL_OBJECTS * OBJ_BYTES)
    yield s
    dispose(s)


def alloc_registered(store: Store, nbytes: int, *, fill: int | None = None) -> np.ndarray:
    """A host buffer of ``nbytes`` (uint8) registered with ``store``.

    The buffer is the middle of a larger allocation: the GUARD bytes either side are never
    registered, so ``addr(buf) - 1`` and ``addr(buf) + nbytes`` are known to lie outside
    registered memory. The returned view keeps the whole allocation alive.
    """
    whole = np.zeros(nbytes + 2 * GUARD, dtype=np.uint8)
    buf = whole[GUARD : GUARD + nbytes]
    if fill is not None:
        buf[:] = fill
    store.register([(addr(buf), nbytes)])
    return buf


def content(key: str, size: int = OBJ_BYTES) -> np.ndarray:
    """The bytes the suite stores under ``key``: a deterministic function of the key."""
    return np.frombuffer(hashlib.shake_256(key.encode()).digest(size), dtype=np.uint8)


def addr(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


def usage(store: Store) -> StoreUsage:
    assert isinstance(store, SupportsUsage), f"{type(store).__name__} does not report usage()"
    return store.usage()


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
