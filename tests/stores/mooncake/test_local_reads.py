"""Local reads: a load of objects held in this process's own Mooncake segment copies straight
from the segment, and everything else (other segments, local reads off, a session older than
its window, a range past the object) still goes through Mooncake's transfer engine. Real
``mooncake_master`` on loopback; bytes are compared every time."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvflow
from kvflow.abc import Direction
from tests.support.pools import mooncake_store

N = 4  # objects
SIZE = 256 << 10  # bytes per object
WINDOW_S = 60.0  # where a load must copy directly: no stall of the machine outlasts the window


@pytest.fixture
def buffers() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.integers(0, 256, N * SIZE, dtype=np.uint8), np.zeros(N * SIZE, dtype=np.uint8)


def save(store: kvflow.MooncakeStore, src: np.ndarray, keys: list[str]) -> None:
    store.register([(src.ctypes.data, src.nbytes)])
    session = store.open_write(keys, SIZE)
    local = src.ctypes.data + np.arange(N, dtype=np.int64) * SIZE
    assert store.batch_copy(session.addrs, local, np.full(N, SIZE), Direction.TO_POOL).size == 0
    store.finish_write(session, np.ones(N, dtype=bool))


def load(store: kvflow.MooncakeStore, dst: np.ndarray, keys: list[str], halves: int = 2) -> None:
    """Load every object in ``halves`` calls of one range per object (as layers do)."""
    store.register([(dst.ctypes.data, dst.nbytes)])
    session = store.open_read(keys)
    assert session.found.all()
    try:
        part = SIZE // halves
        for h in range(halves):
            local = dst.ctypes.data + np.arange(N, dtype=np.int64) * SIZE + h * part
            failed = store.batch_copy(
                session.addrs + h * part, local, np.full(N, part), Direction.FROM_POOL
            )
            assert failed.size == 0
    finally:
        store.close_read(session)


def keys(tag: str) -> list[str]:
    return [f"{tag}/{i}" for i in range(N)]


def test_objects_in_the_own_segment_are_copied_directly(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    src, dst = buffers
    store = mooncake_store(64 << 20, local_read_window_s=WINDOW_S)
    try:
        assert store.stats().local_endpoint
        save(store, src, keys("a"))
        before = store.stats()
        load(store, dst, keys("a"))
        after = store.stats()
        assert np.array_equal(src, dst)
        assert after.local_copies - before.local_copies == 2
        assert after.copy_calls == before.copy_calls  # no transfer-engine call for the load
        assert after.master_calls - before.master_calls == 3  # start, replicas, end
    finally:
        store.close()


def test_local_reads_off_copies_through_the_transfer_engine(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    src, dst = buffers
    store = mooncake_store(64 << 20, local_reads=False)
    try:
        assert store.stats().local_endpoint == ""
        save(store, src, keys("b"))
        before = store.stats()
        load(store, dst, keys("b"))
        after = store.stats()
        assert np.array_equal(src, dst)
        assert after.local_copies == 0
        assert after.copy_calls - before.copy_calls == 2
        assert after.master_calls - before.master_calls == 2  # start, end
    finally:
        store.close()


def test_after_the_window_copies_go_through_the_transfer_engine(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    src, dst = buffers
    store = mooncake_store(64 << 20, local_read_window_s=0.05)
    try:
        save(store, src, keys("c"))
        store.register([(dst.ctypes.data, dst.nbytes)])
        session = store.open_read(keys("c"))
        time.sleep(0.1)
        local = dst.ctypes.data + np.arange(N, dtype=np.int64) * SIZE
        failed = store.batch_copy(session.addrs, local, np.full(N, SIZE), Direction.FROM_POOL)
        store.close_read(session)
        assert failed.size == 0 and np.array_equal(src, dst)
        assert store.stats().local_copies == 0
    finally:
        store.close()


def test_objects_in_another_segment_go_through_the_transfer_engine(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    """Two clients in one process, each with a segment: B reads what A stored in A's segment
    through the transfer engine (A's memory is in this process too, but it is not B's)."""
    src, dst = buffers
    a = mooncake_store(64 << 20, key_prefix="shared-local-reads/", local_read_window_s=WINDOW_S)
    b = mooncake_store(64 << 20, key_prefix="shared-local-reads/", local_read_window_s=WINDOW_S)
    try:
        assert a.stats().local_endpoint != b.stats().local_endpoint
        save(a, src, keys("d"))
        load(b, dst, keys("d"))
        assert np.array_equal(src, dst)
        assert b.stats().local_copies == 0 and b.stats().copy_calls == 2
        dst[:] = 0
        load(a, dst, keys("d"))
        assert np.array_equal(src, dst) and a.stats().local_copies == 2
    finally:
        b.close()
        a.close()


def test_a_range_past_the_object_fails_and_copies_nothing(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    src, dst = buffers
    store = mooncake_store(64 << 20)
    try:
        save(store, src, keys("e"))
        store.register([(dst.ctypes.data, dst.nbytes)])
        session = store.open_read(keys("e"))
        local = dst.ctypes.data + np.arange(N, dtype=np.int64) * SIZE
        sizes = np.full(N, SIZE // 2)
        offsets = np.array([0, 0, SIZE // 2 + 4096, 0], dtype=np.int64)  # object 2 overruns
        failed = store.batch_copy(session.addrs + offsets, local, sizes, Direction.FROM_POOL)
        store.close_read(session)
        assert failed.tolist() == [2]
        assert not dst[2 * SIZE : 3 * SIZE].any()
        for i in (0, 1, 3):
            assert np.array_equal(
                dst[i * SIZE : i * SIZE + SIZE // 2], src[i * SIZE : i * SIZE + SIZE // 2]
            )
    finally:
        store.close()
