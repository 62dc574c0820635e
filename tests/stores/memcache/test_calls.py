"""Which memcache calls MemcacheStore makes, in which order, with which arguments, when kvflow's
real engine saves and loads N layers: metadata once per request batch, one batch_copy per layer
(split only by the configured maxima), the copy types that match the local memory, and read
leases shared by the sessions of one process as memcache shares them."""

from __future__ import annotations

import numpy as np
import pytest

import kvflow
from kvflow import ChunkStatus
from kvflow.abc import Direction, WriteStatus
from kvflow.stores.memcache.client import COPY_G2H, COPY_G2L, COPY_H2G, COPY_L2G, READABLE
from tests.support.memcache import CHUNK, chunk_keys, layout_of, same_blocks, tokens
from tests.support.memcache_standin import MemcacheStandIn
from tests.support.pools import memcache_standin_store

METADATA = {
    "batch_is_exist",
    "batch_get_key_info",
    "batch_alloc",
    "batch_write_finish",
    "batch_add_lease",
    "batch_remove_lease",
    "remove_batch",
}


@pytest.mark.parametrize("layers", [1, 5, 32])
def test_save_and_load_call_memcache_once_per_batch_and_copy_once_per_layer(
    standin: MemcacheStandIn, layers: int
) -> None:
    caches, layout = layout_of(layers)
    store = memcache_standin_store(0, client=standin)
    config = kvflow.EngineConfig(chunk_blocks=CHUNK)
    nbytes = layout.object_bytes(CHUNK)
    with kvflow.SyncTransferEngine(layout, store, config) as engine:
        assert standin.names() == ["register_buffer"] * len(layout.regions())
        assert standin.registered() == sorted(layout.regions())
        ids = tokens(4)
        keys = chunk_keys(engine, ids)

        standin.calls.clear()
        assert engine.save(ids, np.arange(8)).ok
        assert standin.names() == [
            "batch_is_exist",
            "batch_alloc",
            *["batch_copy"] * layers,
            "batch_write_finish",
        ]
        exist, alloc, *copies, finish = standin.calls
        assert exist.args == (tuple(keys),)
        assert alloc.args == (tuple(keys), (nbytes,) * 4, 1, store.config.write_lease_ttl_ms)
        assert finish.args == (tuple(keys), (0, 0, 0, 0))
        infos = standin.batch_get_key_info(keys)
        gvas = {k: info.gva_list()[0] for k, info in zip(keys, infos, strict=True)}
        offsets = layout.layer_offsets(CHUNK)
        for layer, copy in enumerate(copies):
            pool, local, sizes, direct = copy.args
            assert direct == COPY_H2G
            assert sum(sizes) == 4 * CHUNK * layout.layer_block_bytes(layer)
            starts = {gvas[k] + int(offsets[layer]) for k in keys}
            assert starts <= set(pool), f"layer {layer} does not start at its objects' offsets"
            assert all(layout.part_bases[layer][0] <= p for p in local)
        assert standin.objects() == dict.fromkeys(keys, "readable")

        standin.calls.clear()
        assert engine.lookup(ids) == len(ids)
        assert [(c.name, c.args, c.kwargs) for c in standin.calls] == [
            ("batch_get_key_info", (tuple(keys),), {"flag": READABLE})
        ]

        standin.calls.clear()
        loaded = engine.load(ids, np.arange(16, 24))
        assert loaded.ok
        assert standin.names() == [
            "batch_add_lease",
            "batch_get_key_info",
            *["batch_copy"] * layers,
            "batch_remove_lease",
        ]
        lease, info, *copies, release = standin.calls
        assert lease.args == (tuple(keys), store.config.read_lease_ttl_ms)
        assert info.args == (tuple(keys),) and info.kwargs == {"flag": READABLE}
        assert all(c.args[3] == COPY_G2H for c in copies)
        assert release.args == (tuple(keys),)
        assert standin.leased() == set()
        assert same_blocks(caches, np.arange(8), np.arange(16, 24))
        standin.calls.clear()
    assert standin.names() == ["unregister_buffer"] * len(layout.regions())
    assert store.stats().meta_calls == 3 + 1 + 3  # save, lookup, load: whatever the layers
    store.close()
    assert not set(standin.names()) & METADATA  # nothing was left open to release


@pytest.mark.parametrize(
    ("max_batch", "max_bytes", "calls_per_layer"),
    [(1, 1 << 30, 4), (3, 1 << 30, 2), (4096, 64, 4), (4096, 128, 2), (4096, 1 << 30, 1)],
)
def test_copies_are_split_by_the_configured_maxima(
    standin: MemcacheStandIn, max_batch: int, max_bytes: int, calls_per_layer: int
) -> None:
    """Four chunks in blocks far apart: four ranges of 64 bytes per layer, split as configured."""
    caches, layout = layout_of(3, blocks=64)
    store = memcache_standin_store(
        0, client=standin, max_copy_batch=max_batch, max_copy_bytes=max_bytes
    )
    blocks = np.array([0, 1, 10, 11, 20, 21, 30, 31])
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        ids = tokens(4)
        standin.calls.clear()
        assert e.save(ids, blocks).ok
        copies = [c for c in standin.calls if c.name == "batch_copy"]
        assert len(copies) == 3 * calls_per_layer
        assert all(len(c.args[0]) <= max_batch for c in copies)
        assert all(sum(c.args[2]) <= max(max_bytes, 64) for c in copies)
        assert e.load(ids, blocks + 32).ok
        assert same_blocks(caches, blocks, blocks + 32)
    assert store.stats().copy_calls == 2 * 3 * calls_per_layer


@pytest.mark.parametrize("kind", ["host", "device"])
def test_copy_types_follow_where_the_kv_caches_live(kind: str) -> None:
    standin = MemcacheStandIn(4 << 20, local_kind=kind)
    caches, layout = layout_of(2)
    store = memcache_standin_store(0, client=standin, local_memory=kind)
    store.device_memory = frozenset({"cpu"})  # the stand-in's "device" memory is host memory
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        ids = tokens(2)
        assert e.save(ids, np.arange(4)).ok
        assert e.load(ids, np.arange(8, 12)).ok
        assert same_blocks(caches, np.arange(4), np.arange(8, 12))
    directs = [c.args[3] for c in standin.calls if c.name == "batch_copy"]
    to_pool, from_pool = (COPY_H2G, COPY_G2H) if kind == "host" else (COPY_L2G, COPY_G2L)
    assert directs == [to_pool, to_pool, from_pool, from_pool]


def test_device_copy_types_on_host_memory_fail_every_chunk() -> None:
    """The copy type matters: a store set up for NPU memory refuses host KV caches up front
    (the engine checks ``Store.device_memory``), and if host memory is copied with L2G anyway
    memcache refuses it and nothing is stored."""
    standin = MemcacheStandIn(4 << 20, local_kind="host")
    _, layout = layout_of(2)
    store = memcache_standin_store(0, client=standin, local_memory="device")
    with pytest.raises(kvflow.LayoutError, match="npu"):
        kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK))
    store.device_memory = frozenset({"cpu"})  # forced: the copies themselves must fail
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        ids = tokens(2)
        result = e.save(ids, np.arange(4))
        assert result.count(ChunkStatus.FAILED) == 2
        assert e.lookup(ids) == 0
    assert standin.objects() == {}  # aborted: batch_write_finish with failures removed them


def test_read_sessions_share_one_lease_per_key(
    standin: MemcacheStandIn, store: kvflow.MemcacheStore
) -> None:
    """memcache keeps one read lease per key and process: a second open_read renews it and only
    the last close_read of the key ends it."""
    session = store.open_write(["a", "b"], 4096)
    store.finish_write(session, np.ones(2, dtype=bool))
    standin.calls.clear()
    first = store.open_read(["a"])
    second = store.open_read(["a", "b"])
    assert standin.names() == ["batch_add_lease", "batch_get_key_info"] * 2
    assert standin.leased() == {"a", "b"}
    assert int(first.addrs[0]) == int(second.addrs[0])
    store.close_read(first)
    assert standin.names()[-1] == "batch_get_key_info"  # "a" is still read by `second`
    assert standin.leased() == {"a", "b"}
    assert store.stats().leases == 2
    store.close_read(second)
    assert standin.calls[-1].name == "batch_remove_lease"
    assert set(standin.calls[-1].args[0]) == {"a", "b"}
    assert standin.leased() == set()


def test_pending_keys_are_never_allocated_twice(
    standin: MemcacheStandIn, store: kvflow.MemcacheStore
) -> None:
    first = store.open_write(["a", "b"], 4096)
    standin.calls.clear()
    second = store.open_write(["b", "c", "c"], 4096)
    assert second.status.tolist() == [WriteStatus.EXISTS, WriteStatus.GRANTED, WriteStatus.EXISTS]
    assert [c.args[0] for c in standin.calls] == [("c",), ("c",)]  # batch_is_exist, batch_alloc
    assert store.stats().pending_writes == 3
    store.finish_write(second, np.ones(3, dtype=bool))
    store.finish_write(first, np.array([True, False]))
    assert standin.objects() == {"a": "readable", "c": "readable"}
    assert store.lookup(["a", "b", "c"]).tolist() == [True, False, True]


def test_keys_carry_the_prefix_to_memcache(standin: MemcacheStandIn) -> None:
    store = memcache_standin_store(0, client=standin, key_prefix="dep1/")
    session = store.open_write(["a"], 4096)
    store.finish_write(session, np.ones(1, dtype=bool))
    assert standin.objects() == {"dep1/a": "readable"}
    assert store.lookup(["a"]).tolist() == [True]
    reading = store.open_read(["a"])
    assert standin.leased() == {"dep1/a"}
    store.close_read(reading)
    store.close()


def test_close_aborts_pending_writes_and_ends_leases(standin: MemcacheStandIn) -> None:
    store = memcache_standin_store(0, client=standin)
    done = store.open_write(["a"], 4096)
    store.finish_write(done, np.ones(1, dtype=bool))
    store.open_write(["p", "q"], 4096)
    store.open_read(["a"])
    standin.calls.clear()
    store.close()
    assert [(c.name, c.args) for c in standin.calls] == [
        ("batch_write_finish", (("p", "q"), (-1, -1))),
        ("batch_remove_lease", (("a",),)),
    ]  # the client is the caller's: not closed
    assert standin.objects() == {"a": "readable"} and standin.leased() == set()
    with pytest.raises(kvflow.ClosedError):
        store.lookup(["a"])
    with pytest.raises(kvflow.ClosedError):
        store.batch_copy(*(np.zeros(0, np.int64),) * 3, Direction.TO_POOL)


def test_bad_keys_are_refused_before_any_call(
    standin: MemcacheStandIn, store: kvflow.MemcacheStore
) -> None:
    standin.calls.clear()
    for call in (store.lookup, store.open_read, lambda k: store.open_write(k, 64)):
        with pytest.raises(kvflow.InvalidArgumentError, match="at most 255 bytes"):
            call(["ok", "x" * 256])
    assert standin.calls == []
