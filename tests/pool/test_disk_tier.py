"""The pool server's disk tier (``kvflow.pool.tier``) through the real server and its clients:
commits written through to disk, lookups across both tiers, disk-only objects read layer by
layer by the client and promoted afterwards (or first: ``promote``), the engine's loads, a
restart on the same folder, disk eviction tail first, clients that never ask for the disk,
its counters in ``kvflow pool stats`` and Prometheus, and auto-started servers that have one.
Damage, full disks and refusals: ``test_disk_tier_faults.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvflow
from kvflow import ChunkStatus
from kvflow.pool import PoolConfig, PoolServer
from kvflow.pool import protocol as p
from kvflow.stores.arena import slot_bytes
from tests.pool.test_metrics import free_port, pool_stats, scrape
from tests.support.caches import make_caches
from tests.support.disktier import (
    DISK,
    DRAM,
    FILE,
    KEYS,
    OBJ,
    SLOT,
    disk_pool,
    files,
    keys_of,
    on_disk,
    read_layers,
    save,
    shared_store,
    wait_idle,
    wrong,
)
from tests.support.processes import ServeProcess, stop_servers
from tests.support.waits import wait_until
from tests.support.wire import Greeted, greet, recv_exact

# -- write-through and lookups --------------------------------------------------------------------


def test_commits_are_written_through_and_found_in_either_tier(
    pool: PoolServer, store: kvflow.SharedStore, disk_dir: Path
) -> None:
    s = pool.stats()
    assert (s["demotions"], s["demotion_bytes"], s["demotions_skipped"]) == (16, 16 * OBJ, 0)
    assert (s["disk_objects"], s["disk_used"], s["disk_capacity"]) == (16, 16 * FILE, 8 << 20)
    assert (s["objects"], s["evictions"]) == (8, 8)  # DRAM kept the last eight
    assert len(files(disk_dir)) == 16 and files(disk_dir, ".tmp") == []
    assert store.lookup(KEYS).all()
    assert pool.stats()["disk_hits"] == len(DISK)  # found on disk only
    assert not store.lookup(["never saved"]).any()


# -- reads -----------------------------------------------------------------------------------------


def test_disk_only_objects_are_read_layer_by_layer_then_promoted(
    pool: PoolServer, store: kvflow.SharedStore
) -> None:
    wanted = DISK[:4] + DRAM[:2]  # every layer's copy mixes files and the arena
    session = store.open_read(wanted)
    try:
        assert session.found.all()
        assert on_disk(session) == [True] * 4 + [False] * 2
        out, failed = read_layers(store, session)
    finally:
        store.close_read(session)
    assert failed == []
    assert wrong(out, wanted) == []
    assert pool.stats()["disk_reads_served"] == 4
    s = wait_idle(pool.stats)  # promoted once the session ended
    assert (s["promotions"], s["promotion_bytes"], s["promotions_failed"]) == (4, 4 * OBJ, 0)
    assert s["leases"] == 0 and store.disk_reads.failed == 0

    again = store.open_read(DISK[:4])  # in DRAM now
    try:
        assert again.found.all() and not any(on_disk(again))
        out, failed = read_layers(store, again)
    finally:
        store.close_read(again)
    assert failed == []
    assert wrong(out, DISK[:4]) == []
    assert pool.stats()["disk_reads_served"] == 4


def test_promote_mode_copies_into_dram_before_answering(sock_dir: str, disk_dir: Path) -> None:
    path = f"{sock_dir}/pool.sock"
    with disk_pool(path, disk_dir, disk_reads="promote") as server, shared_store(path) as store:
        save(store, KEYS)
        session = store.open_read(DISK[:4])
        try:
            assert session.found.all() and not any(on_disk(session))  # arena addresses
            assert server.stats()["promotions"] == 4  # before the answer, not meanwhile
            out, failed = read_layers(store, session)
        finally:
            store.close_read(session)
        assert failed == []
        assert wrong(out, DISK[:4]) == []
        s = server.stats()
        assert (s["disk_reads_served"], s["promotion_bytes"], s["promotions_failed"]) == (
            0, 4 * OBJ, 0,
        )  # fmt: skip


BS, CHUNK = 16, 2


def test_the_engine_loads_prompts_larger_than_dram_bit_exact(sock_dir: str, disk_dir: Path) -> None:
    """Four prompts of four chunks through a SyncTransferEngine, DRAM room for six chunks:
    each loads back whole into zeroed blocks, most of it from disk."""
    path = f"{sock_dir}/pool.sock"
    caches = make_caches(num_layers=4, num_blocks=64, block_shape=(2, 16, 200), seed=5)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    nbytes = layout.object_bytes(CHUNK)  # 12,800 bytes a layer: no 16 KiB boundary
    config = PoolConfig(
        socket=path, capacity=6 * slot_bytes(nbytes), disk_dir=str(disk_dir), disk_capacity="4MiB"
    )
    prompts = [np.random.default_rng(i).integers(0, 30_000, 4 * CHUNK * BS) for i in range(4)]
    engine_config = kvflow.EngineConfig(chunk_blocks=CHUNK, op_timeout_s=60, copy_timeout_s=60)
    with PoolServer(config) as server, shared_store(path) as store:
        with kvflow.SyncTransferEngine(layout, store, engine_config) as engine:
            for i, tokens in enumerate(prompts):
                assert engine.save(tokens, np.arange(8 * i, 8 * i + 8)).ok
                wait_idle(server.stats)
            for layer in caches:
                layer[32:] = 0
            for i, tokens in enumerate(prompts):
                loaded = engine.load(tokens, np.arange(32 + 8 * i, 40 + 8 * i))
                assert loaded.ok and loaded.count(ChunkStatus.OK) == 4, loaded
        s = server.stats()
    for layer in caches:  # as bytes: random float16 bits include NaNs
        raw = layer.numpy().view(np.uint8)
        np.testing.assert_array_equal(raw[:32], raw[32:])
    assert s["evictions"] >= 10 and s["disk_reads_served"] >= 8, s


def test_a_restarted_pool_serves_what_its_disk_holds(sock_dir: str, disk_dir: Path) -> None:
    path = f"{sock_dir}/pool.sock"
    with disk_pool(path, disk_dir) as server, shared_store(path) as store:
        save(store, KEYS)
        assert server.stats()["disk_objects"] == 16
    with disk_pool(path, disk_dir) as server, shared_store(path) as store:
        s = server.stats()
        assert (s["disk_recovered"], s["disk_objects"], s["objects"]) == (16, 16, 0)
        assert store.lookup(KEYS).all()
        session = store.open_read(KEYS)
        try:
            assert all(on_disk(session))
            out, failed = read_layers(store, session)
        finally:
            store.close_read(session)
    assert failed == []
    assert wrong(out, KEYS) == []


@pytest.mark.parametrize("other", ["model", "layout"])
def test_a_disk_written_for_another_model_or_layout_is_never_read(
    sock_dir: str, disk_dir: Path, other: str
) -> None:
    """An engine of another model name, or of another layout (the cache's shape), on a pool
    restarted over the first one's disk finds none of its chunks; the first one finds all."""
    path = f"{sock_dir}/pool.sock"
    caches = make_caches(num_layers=2, num_blocks=16, block_shape=(2, 16, 64), seed=1)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    config = PoolConfig(socket=path, capacity="1MiB", disk_dir=str(disk_dir), disk_capacity="4MiB")
    tokens = np.random.default_rng(3).integers(0, 30_000, 2 * CHUNK * BS)
    first = kvflow.EngineConfig(model="first", chunk_blocks=CHUNK)
    with PoolServer(config) as server, shared_store(path) as store:
        with kvflow.SyncTransferEngine(layout, store, first) as engine:
            assert engine.save(tokens, np.arange(2 * CHUNK)).ok
        wait_idle(server.stats)
    if other == "layout":
        caches = make_caches(num_layers=2, num_blocks=16, block_shape=(2, 16, 32), seed=1)
    second = kvflow.EngineConfig(
        model="second" if other == "model" else "first", chunk_blocks=CHUNK
    )
    elsewhere = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    with PoolServer(config) as server, shared_store(path) as store:
        assert server.stats()["disk_recovered"] == 2
        with kvflow.SyncTransferEngine(elsewhere, store, second) as engine:
            assert engine.lookup(tokens) == 0
        with kvflow.SyncTransferEngine(layout, store, first) as engine:
            assert engine.lookup(tokens) == 2 * CHUNK * BS


# -- eviction order on disk ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("read", "evicted"),
    [("lookup", "a3"), ("open_read", "a3"), ("nothing", "a2")],
    ids=["lookup", "open_read", "tail-touched-last"],
)
def test_disk_eviction_takes_a_prefix_tail_first(
    sock_dir: str, disk_dir: Path, read: str, evicted: str
) -> None:
    """The disk holds four objects, a prefix saved in one call (its head written last). The
    tail looked up alone is the newest, until the prefix is looked up or read again: then the
    next object written pushes the tail out; otherwise the oldest, the one before it."""
    path = f"{sock_dir}/pool.sock"
    prefix = keys_of("a", 4)
    with (
        disk_pool(path, disk_dir, objects=4, disk_capacity=4 * FILE) as server,
        shared_store(path) as store,
    ):
        save(store, prefix)
        store.lookup(prefix[-1:])
        if read == "lookup":
            store.lookup(prefix)
        elif read == "open_read":
            store.close_read(store.open_read(prefix))
        save(store, ["b0"])
        s = server.stats()
        assert (s["disk_objects"], s["disk_evictions"]) == (4, 1)
        assert server.service.tier is not None
        held = server.service.tier.sizes(prefix) > 0  # without a touch: DRAM would answer
        assert [key for key, h in zip(prefix, held, strict=True) if not h] == [evicted]


# -- clients that never ask for the disk ----------------------------------------------------------


def ask(conn: Greeted, rid: int, op: p.Op, keys: list[str]) -> bytes:
    conn.sock.sendall(p.frame(op, rid, p.encode_keys(tuple(keys))))
    length, _, code, _, got = p.HEADER.unpack(recv_exact(conn.sock, p.HEADER.size))
    body = recv_exact(conn.sock, length)
    assert (code, got) == (p.Code.OK, rid), body
    return body


def test_a_client_that_never_asks_disk_sees_dram_only(
    pool: PoolServer, store: kvflow.SharedStore
) -> None:
    """An older client says HELLO and reads, never DISK: it is never told to read a file."""
    with greet(pool.socket_path) as conn:
        assert conn.flags & p.Feature.DISK
        found = p.parse_flags(ask(conn, 2, p.Op.LOOKUP, KEYS), len(KEYS))
        assert found.astype(bool).tolist() == [False] * 8 + [True] * 8
        _, _, sizes, flags = p.parse_session(ask(conn, 3, p.Op.OPEN_READ, KEYS), len(KEYS))
        assert flags.tolist() == [0] * 8 + [1] * 8
        assert sizes.tolist() == [0] * 8 + [OBJ] * 8
    s = pool.stats()
    assert (s["disk_hits"], s["disk_reads_served"]) == (0, 0)
    assert store.lookup(KEYS).all()  # a client that asked sees both tiers


# -- counters and auto-start -----------------------------------------------------------------------


def test_pool_stats_and_metrics_show_the_disk_tier(
    sock_dir: str, disk_dir: Path, serve: Callable[..., ServeProcess]
) -> None:
    path, port = f"{sock_dir}/pool.sock", free_port()
    disk = ("--disk-dir", str(disk_dir), "--disk-capacity", "8MiB")
    server = serve(path, 8 * SLOT, *disk, "--metrics-port", str(port))
    wait_until(lambda: f"127.0.0.1:{port}/metrics" in server.log(), 60, "the metrics line")
    with shared_store(path) as store:
        save(store, KEYS)
        store.close_read(store.open_read(DISK[:4]))
        wait_idle(store.server_stats)
        assert store.lookup(KEYS).all()
    stats, metrics = pool_stats(path), scrape(port)
    assert {n for n in p.STATS_FIELDS if n.startswith("disk_")} <= set(stats)
    expected = {  # metric: (stat, value)
        "kvflow_pool_disk_capacity_bytes": ("disk_capacity", 8 << 20),
        "kvflow_pool_disk_used_bytes": ("disk_used", 16 * FILE),
        "kvflow_pool_disk_objects": ("disk_objects", 16),
        "kvflow_pool_demotions_total": ("demotions", 16),
        "kvflow_pool_demoted_bytes_total": ("demotion_bytes", 16 * OBJ),
        "kvflow_pool_disk_reads_served_total": ("disk_reads_served", 4),
        "kvflow_pool_promotions_total": ("promotions", 4),
        "kvflow_pool_promoted_bytes_total": ("promotion_bytes", 4 * OBJ),
        "kvflow_pool_disk_hits_total": ("disk_hits", 8),  # the last lookup's
    }
    got = {m: (stat, metrics.get(m), stats[stat]) for m, (stat, _) in expected.items()}
    assert got == {m: (stat, v, v) for m, (stat, v) in expected.items()}


def test_an_auto_started_pool_has_the_disk_tier_asked(sock_dir: str, disk_dir: Path) -> None:
    path = f"{sock_dir}/pool.sock"
    try:
        store = kvflow.SharedStore(
            socket=path,
            auto_start=True,
            capacity=8 * SLOT,
            disk_dir=str(disk_dir),
            disk_capacity="4MiB",
            start_timeout_s=60,
            timeout_s=60,
        )
        try:
            assert store.server_stats()["disk_capacity"] == 4 << 20
            save(store, KEYS[:4])
            assert len(files(disk_dir)) == 4
        finally:
            store.close()
    finally:
        stop_servers(path)
