"""``SharedStore.prepare_writes``: a save's copies checked once for all its layers. Each layer's
``copy`` writes what ``batch_copy`` would, fails the ranges whose write slot is gone by then
(never writing into a slot handed to another object), fails everything after the connection
is lost, and refuses bad input when prepared, leaving the pool unchanged. The engine's saves on
the shared pool go through it; a wrapper's ``batch_copy`` is never bypassed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvflow
import kvflow.pool.prepared as prepared_module
from kvflow.abc import Direction
from kvflow.errors import ClosedError, InvalidArgumentError
from kvflow.results import ChunkStatus
from kvflow.stores.wrapper import StoreWrapper
from tests.support.objects import (
    OBJ_BYTES,
    addr,
    alloc_registered,
    assert_unchanged,
    content,
    pool_state,
    read_objects,
    write_objects,
)
from tests.support.pools import ServedSharedStore, dispose
from tests.support.waits import wait_until

HALF = OBJ_BYTES // 2


def i64(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@pytest.fixture
def store() -> Iterator[ServedSharedStore]:
    served = ServedSharedStore(8 * OBJ_BYTES, retry_interval_s=0.05)
    try:
        yield served
    finally:
        dispose(served)


def halves(session: kvflow.abc.WriteSession, src: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """Two "layers" per object: its first half, then its second, from ``src`` (the objects'
    bytes one after the other)."""
    n = len(session.keys)
    base, local = i64(session.addrs), addr(src) + OBJ_BYTES * np.arange(n, dtype=np.int64)
    sizes = np.full(n, HALF, dtype=np.int64)
    return [(base, local, sizes), (base + HALF, local + HALF, sizes)]


def test_each_layer_copies_what_batch_copy_would(store: ServedSharedStore) -> None:
    keys = ["a", "b", "c"]
    src = alloc_registered(store, len(keys) * OBJ_BYTES)
    src[:] = np.concatenate([content(k) for k in keys])
    session = store.open_write(keys, OBJ_BYTES)
    prepared = store.prepare_writes(halves(session, src))
    assert prepared is not None and len(prepared) == 2
    assert prepared.copy(1).size == 0  # any order, as a copy thread's
    assert prepared.copy(0).size == 0
    store.finish_write(session, np.ones(3, dtype=bool))
    got = read_objects(store, keys, OBJ_BYTES)
    for key in keys:
        np.testing.assert_array_equal(got[key], content(key))


def test_a_range_whose_slot_was_given_up_fails_and_writes_nothing(
    store: ServedSharedStore,
) -> None:
    """The slot goes back to the pool and to another object; the prepared copy of it fails
    and that object's bytes stay exact. A session that came and went elsewhere meanwhile
    changes nothing for the ranges still held."""
    src = alloc_registered(store, 2 * OBJ_BYTES, fill=0xEE)
    first = store.open_write(["kept"], OBJ_BYTES)
    given_up = store.open_write(["gone"], OBJ_BYTES)
    kept_layers = store.prepare_writes(halves(first, src))
    gone_layers = store.prepare_writes(halves(given_up, src[OBJ_BYTES:]))
    assert kept_layers is not None and gone_layers is not None
    store.finish_write(given_up, np.zeros(1, dtype=bool))  # aborted: its slot is free again
    other = store.open_write(["other"], OBJ_BYTES)
    assert other.addrs[0] == given_up.addrs[0]  # the very slot the prepared copies name
    staged = alloc_registered(store, OBJ_BYTES)
    staged[:] = content("other")
    pool, local, sizes = i64(other.addrs), i64([addr(staged)]), i64([OBJ_BYTES])
    assert store.batch_copy(pool, local, sizes, Direction.TO_POOL).size == 0
    store.finish_write(other, np.ones(1, dtype=bool))
    assert gone_layers.copy(0).tolist() == [0]
    assert gone_layers.copy(1).tolist() == [0]
    np.testing.assert_array_equal(
        read_objects(store, ["other"], OBJ_BYTES)["other"], content("other")
    )
    src[:OBJ_BYTES] = content("kept")
    assert kept_layers.copy(0).size == 0 and kept_layers.copy(1).size == 0
    store.finish_write(first, np.ones(1, dtype=bool))
    np.testing.assert_array_equal(read_objects(store, ["kept"], OBJ_BYTES)["kept"], content("kept"))


@pytest.mark.parametrize("how", ["dropped", "server gone"])
def test_after_the_connection_is_lost_every_range_fails(store: ServedSharedStore, how: str) -> None:
    """Dropped by a call that found the server gone, or not yet noticed by any call."""
    src = alloc_registered(store, 2 * OBJ_BYTES)
    session = store.open_write(["a", "b"], OBJ_BYTES)
    prepared = store.prepare_writes(halves(session, src))
    assert prepared is not None
    store.stop_server()
    if how == "dropped":
        with pytest.raises(kvflow.StoreUnavailableError):
            store.lookup(["a"])  # finds the server gone: the connection and its slots go
    else:
        wait_until(lambda: store._conn is not None and store._conn.peer_gone(), 60, "the close")
    assert prepared.copy(0).tolist() == [0, 1]
    assert store._link.in_flight == 0


def test_a_copy_is_in_flight_while_it_runs_and_uses_what_was_checked(
    store: ServedSharedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dropped connection waits for copies in flight before its memory goes: a prepared copy
    counts as one while it runs. The arrays checked are the ones copied: changing the
    caller's afterwards changes nothing."""
    src = alloc_registered(store, OBJ_BYTES)
    src[:] = content("a")
    session = store.open_write(["a"], OBJ_BYTES)
    layers = halves(session, src)
    prepared = store.prepare_writes(layers)
    assert prepared is not None
    for _, local, _ in layers:
        local[:] = 1 << 40  # the caller's arrays now point outside every registered region
    seen: list[int] = []
    copy_ranges = prepared_module.copy_ranges

    def watched(*args: object, **kwargs: object) -> None:
        seen.append(store._link.in_flight)
        copy_ranges(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prepared_module, "copy_ranges", watched)
    assert prepared.copy(0).size == 0 and prepared.copy(1).size == 0
    assert seen == [1, 1] and store._link.in_flight == 0
    store.finish_write(session, np.ones(1, dtype=bool))
    np.testing.assert_array_equal(read_objects(store, ["a"], OBJ_BYTES)["a"], content("a"))


@pytest.mark.parametrize(
    ("case", "name"),
    [
        ("local outside registered memory", "local_addrs"),
        ("pool outside the arena", "pool_addrs"),
        ("arrays of different lengths", "sizes"),
    ],
)
def test_bad_input_is_refused_when_prepared(store: ServedSharedStore, case: str, name: str) -> None:
    write_objects(store, {"x": content("x")})
    src = alloc_registered(store, OBJ_BYTES)
    session = store.open_write(["a"], OBJ_BYTES)
    layers = halves(session, src)
    pool, local, sizes = layers[1]
    if case == "local outside registered memory":
        layers[1] = (pool, local + OBJ_BYTES, sizes)
    elif case == "pool outside the arena":
        layers[1] = (pool + (1 << 40), local, sizes)
    else:
        layers[1] = (pool, np.concatenate([local, local]), sizes)
    before = pool_state(store, ["x", "a"])
    with pytest.raises(InvalidArgumentError) as raised:
        store.prepare_writes(layers)
    assert raised.value.argument == name
    assert_unchanged(store, before)
    store.finish_write(session, np.zeros(1, dtype=bool))


def test_a_layer_out_of_range_and_a_closed_store_are_refused(store: ServedSharedStore) -> None:
    src = alloc_registered(store, OBJ_BYTES)
    session = store.open_write(["a"], OBJ_BYTES)
    prepared = store.prepare_writes(halves(session, src))
    assert prepared is not None
    for layer in (2, -1, True):
        with pytest.raises(InvalidArgumentError) as raised:
            prepared.copy(layer)
        assert raised.value.argument == "layer"
    store.close()
    with pytest.raises(ClosedError):
        prepared.copy(0)
    assert store._link.in_flight == 0
    with pytest.raises(ClosedError):
        store.prepare_writes(halves(session, src))
    assert store.prepare_writes([]) is None


def test_a_wrapper_offers_none_so_its_batch_copy_runs(store: ServedSharedStore) -> None:
    src = alloc_registered(store, OBJ_BYTES)
    session = store.open_write(["a"], OBJ_BYTES)
    assert StoreWrapper(store).prepare_writes(halves(session, src)) is None
    store.finish_write(session, np.zeros(1, dtype=bool))


class FailingLayer(ServedSharedStore):
    """The real pool; the prepared copy of one layer reports the first range failed (a test's
    fault), and every ``batch_copy`` is recorded."""

    def __init__(self, capacity: int, fail_layer: int) -> None:
        super().__init__(capacity)
        self.fail_layer = fail_layer
        self.batch_copies: list[int] = []  # ranges per call
        self.prepared_copies: list[int] = []  # layers

    def prepare_writes(self, layers):  # type: ignore[no-untyped-def]
        inner = super().prepare_writes(layers)
        store = self

        class Faulty:
            def copy(self, layer: int) -> np.ndarray:
                store.prepared_copies.append(layer)
                failed = inner.copy(layer)
                return np.union1d(failed, [0]) if layer == store.fail_layer else failed

        return Faulty()

    def batch_copy(self, pool_addrs, local_addrs, sizes, direction):  # type: ignore[no-untyped-def]
        if direction == Direction.TO_POOL:
            self.batch_copies.append(len(sizes))
        return super().batch_copy(pool_addrs, local_addrs, sizes, direction)


@pytest.mark.parametrize("mode", ["inline", "copy-thread", "deferred"])
def test_the_engines_saves_use_them_and_a_failed_chunk_is_not_committed(mode: str) -> None:
    """A save's layers go through the prepared copies. One that fails a chunk fails it in the
    result, the other chunks are committed and the failed one is not. Through the copy thread
    one layer at a time (``save_backlog=1``), the layers after it go through ``batch_copy``
    without that chunk's ranges; inline, every layer is settled after the last one; deferred,
    the layers reach the copy thread together, so those after it may or may not be copied
    before the failure is known."""
    layers, bs, chunk = 4, 16, 2
    store = FailingLayer(16 << 20, fail_layer=1)
    caches = [torch.randn(2, 8, bs, 2, 8) for _ in range(layers)]
    layout = kvflow.KVLayout.from_kv_split_tensors(caches, block_size=bs)
    config = kvflow.EngineConfig(
        model="prepared",
        chunk_blocks=chunk,
        inline_saves=mode == "inline",
        deferred_saves=mode == "deferred",
        save_backlog=1,
    )
    engine = kvflow.SyncTransferEngine(layout, store, config)
    try:
        tokens, blocks = np.arange(3 * chunk * bs), np.array([0, 1, 3, 4, 6, 7])
        handle = engine.start_save([(tokens, blocks)])
        for layer in range(layers):
            handle.layer_written(layer)
        result = handle.wait()
        if mode == "inline":
            assert store.prepared_copies == [0, 1, 2, 3] and store.batch_copies == []
        elif mode == "copy-thread":
            assert store.prepared_copies == [0, 1]
            # a chunk's two adjacent blocks make one range of K and one of V: 2 of 3 chunks left
            assert store.batch_copies == [2 * 2, 2 * 2]
        else:
            assert {0, 1} <= set(store.prepared_copies)
            assert len(store.prepared_copies) + len(store.batch_copies) == layers
            assert set(store.batch_copies) <= {2 * 2}
        status = result.requests[0].chunk_status.tolist()
        assert status == [ChunkStatus.FAILED, ChunkStatus.OK, ChunkStatus.OK]
        keys = engine.engine.plan([(tokens, blocks)], load=False).keys
        assert store.lookup(keys).tolist() == [False, True, True]
    finally:
        engine.close()
        dispose(store)


class Unprepared(ServedSharedStore):
    """The real pool, whose ``prepare_writes`` finds it unavailable (a test's fault)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.batch_copies = 0

    def prepare_writes(self, layers):  # type: ignore[no-untyped-def]
        raise kvflow.StoreUnavailableError("not now")

    def batch_copy(self, pool_addrs, local_addrs, sizes, direction):  # type: ignore[no-untyped-def]
        self.batch_copies += 1
        return super().batch_copy(pool_addrs, local_addrs, sizes, direction)


def test_a_save_whose_preparation_fails_copies_layer_by_layer() -> None:
    layers, bs = 4, 16
    store = Unprepared(16 << 20)
    caches = [torch.randn(2, 8, bs, 2, 8) for _ in range(layers)]
    layout = kvflow.KVLayout.from_kv_split_tensors(caches, block_size=bs)
    engine = kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2))
    try:
        tokens, blocks = np.arange(2 * 2 * bs), np.arange(4)
        handle = engine.start_save([(tokens, blocks)])
        for layer in range(layers):
            handle.layer_written(layer)
        assert handle.wait().ok
        assert store.batch_copies == layers
        assert engine.lookup(tokens) == len(tokens)
    finally:
        engine.close()
        dispose(store)
