"""memcache's failures, translated at the boundary: refused allocations, failed copies, key
information that does not come back, leases refused or run out, commits refused, a client that
is down or stalls. Failed chunks are reported failed (never loaded), the rest go on, nothing
stays leased or half-written, and service resumes without a restart."""

from __future__ import annotations

import logging
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

import kvflow
from kvflow import ChunkStatus
from kvflow.abc import Direction, Store, WriteStatus
from kvflow.stores.memcache import store as memcache_store
from tests.support.memcache import CHUNK, chunk_keys, layout_of, same_blocks, tokens
from tests.support.memcache_standin import NOT_FOUND, KeyInfoStandIn, MemcacheStandIn
from tests.support.pools import memcache_standin_store

GRANTED, EXISTS, NO_SPACE, FAILED = (
    WriteStatus.GRANTED,
    WriteStatus.EXISTS,
    WriteStatus.NO_SPACE,
    WriteStatus.FAILED,
)


def engine_over(store: Store, layers: int = 3) -> tuple[list[Any], kvflow.SyncTransferEngine]:
    caches, layout = layout_of(layers)
    config = kvflow.EngineConfig(chunk_blocks=CHUNK, op_timeout_s=10, copy_timeout_s=5)
    return caches, kvflow.SyncTransferEngine(layout, store, config)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def registered(store: Store, nbytes: int) -> np.ndarray:
    buf = np.zeros(nbytes, dtype=np.uint8)
    store.register([(int(buf.ctypes.data), nbytes)])
    return buf


# -- allocation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "status"),
    [(0, FAILED), (-1, FAILED), (-3006, EXISTS), (-3016, NO_SPACE), (2**64 - 3013, NO_SPACE)],
)
def test_a_refused_allocation_fails_only_its_key(
    standin: MemcacheStandIn, store: kvflow.MemcacheStore, answer: int, status: WriteStatus
) -> None:
    """memcache answers 0 for a refused allocation (codes, where a binding gives them, name the
    reason; one that came through an unsigned type too); the other keys are granted."""
    standin.alloc_answers["b"] = answer
    session = store.open_write(["a", "b", "c"], 4096)
    assert session.status.tolist() == [GRANTED, status, GRANTED]
    assert session.addrs[1] == 0 and (session.addrs[[0, 2]] > 0).all()
    assert store.stats().pending_writes == 2
    store.finish_write(session, np.ones(3, dtype=bool))
    assert [c.args for c in standin.calls if c.name == "batch_write_finish"] == [
        (("a", "c"), (0, 0))
    ]  # only the keys this store allocated are finished
    assert store.lookup(["a", "b", "c"]).tolist() == [True, False, True]


@pytest.mark.parametrize("counts_allocated", [True, False])
def test_a_key_another_process_is_writing_is_never_granted(counts_allocated: bool) -> None:
    """Another writer allocated "k" first: memcache refuses our allocation with 0. Whether
    batch_is_exist counts allocated objects or not, "k" is not granted, not found, not read."""
    standin = MemcacheStandIn(1 << 20, exist_counts_allocated=counts_allocated)
    store = memcache_standin_store(0, client=standin)
    assert standin.batch_alloc(["k"], [4096])[0] > 0  # the other process
    session = store.open_write(["k", "mine"], 4096)
    assert session.status.tolist() == [EXISTS if counts_allocated else FAILED, GRANTED]
    assert store.lookup(["k"]).tolist() == [False]
    reading = store.open_read(["k"])
    assert reading.found.tolist() == [False] and standin.leased() == set()
    store.close_read(reading)
    store.finish_write(session, np.ones(2, dtype=bool))
    assert standin.objects() == {"k": "allocated", "mine": "readable"}
    store.close()


def test_refused_allocations_through_the_engine(standin: MemcacheStandIn) -> None:
    store = memcache_standin_store(0, client=standin)
    caches, engine = engine_over(store)
    with engine:
        ids = tokens(4)
        keys = chunk_keys(engine, ids)
        standin.alloc_answers[keys[1]] = 0
        standin.alloc_answers[keys[3]] = -3016
        result = engine.save(ids, np.arange(8)).requests[0]
        assert result.chunk_status.tolist() == [
            ChunkStatus.OK,
            ChunkStatus.FAILED,
            ChunkStatus.OK,
            ChunkStatus.NO_SPACE,
        ]
        assert engine.lookup(ids) == CHUNK * 16  # the leading run: chunk 0
        loaded = engine.load(ids, np.arange(16, 24)).requests[0]
        assert loaded.chunk_status.tolist() == [
            ChunkStatus.OK,
            ChunkStatus.MISSING,
            ChunkStatus.OK,
            ChunkStatus.MISSING,
        ]
        assert same_blocks(caches, np.array([0, 1, 4, 5]), np.array([16, 17, 20, 21]))
    stats = store.stats()
    assert (stats.failed_keys, stats.no_space, stats.codes) == (1, 1, {-3016: 1})


# -- copies -------------------------------------------------------------------------------------


def test_a_failed_batch_copy_fails_exactly_its_ranges(standin: MemcacheStandIn) -> None:
    store = memcache_standin_store(0, client=standin, max_copy_batch=2)
    session = store.open_write([f"k{i}" for i in range(6)], 64)
    src = registered(store, 6 * 64)
    real = standin.batch_copy
    seen: list[int] = []

    def second_call_fails(*args: Any) -> int:
        seen.append(len(args[0]))
        return -1 if len(seen) == 2 else real(*args)

    standin.batch_copy = second_call_fails  # type: ignore[method-assign]
    local = np.arange(6, dtype=np.int64) * 64 + int(src.ctypes.data)
    failed = store.batch_copy(session.addrs, local, np.full(6, 64, np.int64), Direction.TO_POOL)
    assert failed.tolist() == [2, 3] and seen == [2, 2, 2]
    standin.batch_copy = lambda *a: (_ for _ in ()).throw(RuntimeError("torn"))  # type: ignore[method-assign]
    failed = store.batch_copy(session.addrs, local, np.full(6, 64, np.int64), Direction.TO_POOL)
    assert failed.tolist() == list(range(6))
    stats = store.stats()
    assert (stats.copy_calls, stats.copy_failures, stats.codes) == (6, 4, {-1: 1})
    store.finish_write(session, np.zeros(6, dtype=bool))


@pytest.mark.parametrize("direction", ["save", "load"])
def test_a_failed_layer_fails_every_chunk_and_leaves_nothing_behind(
    standin: MemcacheStandIn, direction: str
) -> None:
    store = memcache_standin_store(0, client=standin)
    caches, engine = engine_over(store, layers=4)
    with engine:
        ids = tokens(3)
        if direction == "load":
            assert engine.save(ids, np.arange(6)).ok
        real = standin.batch_copy
        copies: list[int] = []

        def layer_two_fails(*args: Any) -> int:
            copies.append(1)
            return -3004 if len(copies) == 3 else real(*args)

        standin.batch_copy = layer_two_fails  # type: ignore[method-assign]
        if direction == "save":
            result = engine.save(ids, np.arange(6)).requests[0]
            # never readable; the abort may follow the result: layer 3's copy, in flight when
            # layer 2 failed, is not waited for (a straggler: kvflow/pipeline/stages.py, _settle)
            assert "readable" not in standin.objects().values()
        else:
            for c in caches:
                c[10:16] = 0
            result = engine.load(ids, np.arange(10, 16)).requests[0]
        assert result.chunk_status.tolist() == [ChunkStatus.FAILED] * 3
        assert len(copies) in (3, 4)  # layer 3 is skipped when layer 2's failure came first
    assert store.stats().open_sessions == 0  # the engine closed: every session ended
    assert standin.leased() == set() and store.stats().leases == 0
    if direction == "save":
        assert standin.objects() == {}  # aborted: batch_write_finish with failures
        finishes = [c for c in standin.calls if c.name == "batch_write_finish"]
        assert [c.args[1] for c in finishes] == [(-1, -1, -1)]


# -- key information and leases -----------------------------------------------------------------


def test_key_information_that_does_not_come_back_is_a_miss(standin: MemcacheStandIn) -> None:
    """The real binding answers [] when its query fails: lookups miss (counted), loads fail
    their chunks and release the leases they took."""
    store = memcache_standin_store(0, client=standin)
    caches, engine = engine_over(store)
    with engine:
        ids = tokens(2)
        assert engine.save(ids, np.arange(4)).ok
        standin.broken.add("batch_get_key_info")
        with pytest.raises(kvflow.StoreUnavailableError, match="answered 0 results for 2"):
            store.lookup(chunk_keys(engine, ids))
        assert engine.lookup(ids) == 0
        assert engine.stats().lookup_errors == 1
        loaded = engine.load(ids, np.arange(8, 12))
        assert loaded.count(ChunkStatus.FAILED) == 2
        assert standin.names()[-1] == "batch_remove_lease" and standin.leased() == set()
        standin.broken.clear()
        assert engine.lookup(ids) == len(ids)  # back, without a restart
        assert engine.load(ids, np.arange(8, 12)).ok
        assert same_blocks(caches, np.arange(4), np.arange(8, 12))


def test_an_object_gone_between_lease_and_key_info_is_missing(
    standin: MemcacheStandIn, store: kvflow.MemcacheStore
) -> None:
    write = store.open_write(["a", "b"], 4096)
    store.finish_write(write, np.ones(2, dtype=bool))
    real = standin.batch_get_key_info

    def b_is_gone(keys: Any, flag: int = 1) -> Any:
        return [
            i if k != "b" else KeyInfoStandIn() for k, i in zip(keys, real(keys, flag), strict=True)
        ]

    standin.batch_get_key_info = b_is_gone  # type: ignore[method-assign]
    session = store.open_read(["a", "b"])
    assert session.found.tolist() == [True, False]
    assert standin.leased() == {"a"}  # the lease of "b" was given back at once
    store.close_read(session)
    assert standin.leased() == set()


def test_refused_leases_are_misses_and_a_down_meta_service_fails_the_batch(
    standin: MemcacheStandIn,
) -> None:
    store = memcache_standin_store(0, client=standin)
    caches, engine = engine_over(store)
    with engine:
        ids = tokens(3)
        keys = chunk_keys(engine, ids)
        assert engine.save(ids, np.arange(6)).ok
        standin.lease_answers[keys[1]] = -3104
        loaded = engine.load(ids, np.arange(10, 16)).requests[0]
        assert loaded.chunk_status.tolist() == [ChunkStatus.OK, ChunkStatus.MISSING, ChunkStatus.OK]
        assert store.stats().lease_failures == 1 and standin.leased() == set()

        standin.lease_answers.update(dict.fromkeys(keys, -3017))  # not connected to the meta
        assert engine.load(ids, np.arange(10, 16)).count(ChunkStatus.FAILED) == 3
        assert store.stats().unavailable == 1

        standin.lease_answers.clear()
        standin.broken.add("batch_remove_lease")  # memcache ends the lease by its time
        assert engine.load(ids, np.arange(10, 16)).ok  # the bytes came under a live lease
        assert same_blocks(caches, np.arange(6), np.arange(10, 16))
    assert store.stats().lease_failures == 1 + 3


def test_a_read_lease_past_its_time_fails_the_copy(
    standin: MemcacheStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the store's clock is the test's: a stall of the machine cannot run the lease out early
    now = [1000.0]
    monkeypatch.setattr(memcache_store, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    store = memcache_standin_store(0, client=standin, read_lease_ttl_ms=100)
    write = store.open_write(["a"], 64)
    src = registered(store, 64)
    src[:] = 7
    put = (write.addrs, i64(int(src.ctypes.data)), i64(64), Direction.TO_POOL)
    assert store.batch_copy(*put).size == 0
    store.finish_write(write, np.ones(1, dtype=bool))
    dst = registered(store, 64)
    session = store.open_read(["a"])
    args = (session.addrs, i64(int(dst.ctypes.data)), i64(64), Direction.FROM_POOL)
    assert store.batch_copy(*args).size == 0 and (dst == 7).all()
    now[0] += 0.1  # past 90 % of the lease
    dst[:] = 0
    assert store.batch_copy(*args).tolist() == [0]
    assert store.stats().expired_leases == 1
    store.close_read(session)


def test_ranges_this_store_does_not_hold_are_refused(
    standin: MemcacheStandIn, store: kvflow.MemcacheStore
) -> None:
    """A GVA is an address in a pool shared by every process: a copy to an object this store
    is not writing (or from one it holds no lease on) could tear another's bytes."""
    write = store.open_write(["a", "b"], 64)
    store.finish_write(write, np.array([True, False]))
    buf = registered(store, 64)
    local = i64(int(buf.ctypes.data))
    for direction in Direction:  # "a" is committed, not leased; "b" was aborted
        for addr in write.addrs:
            with pytest.raises(kvflow.InvalidArgumentError, match="pool_addrs"):
                store.batch_copy(i64(int(addr)), local, i64(64), direction)
    pending = store.open_write(["c"], 64)
    with pytest.raises(kvflow.InvalidArgumentError, match="pool_addrs"):  # past its end
        store.batch_copy(pending.addrs + 1, local, i64(64), Direction.TO_POOL)
    assert [c for c in standin.names() if c == "batch_copy"] == []
    store.finish_write(pending, np.zeros(1, dtype=bool))


# -- commits ------------------------------------------------------------------------------------


def test_a_refused_commit_fails_the_save(standin: MemcacheStandIn) -> None:
    store = memcache_standin_store(0, client=standin)
    caches, engine = engine_over(store)
    with engine:
        ids = tokens(2)
        keys = chunk_keys(engine, ids)
        standin.finish_answers[keys[0]] = -3101
        result = engine.save(ids, np.arange(4))
        assert result.count(ChunkStatus.FAILED) == 2  # the batch is not trusted
        assert store.stats().pending_writes == 0 and store.stats().codes == {-3101: 1}
        session = store.open_write(["x"], 64)
        standin.finish_answers["x"] = -1
        with pytest.raises(kvflow.StoreError, match="did not commit 1"):
            store.finish_write(session, np.ones(1, dtype=bool))


def test_without_batch_write_finish_commits_need_no_call_and_aborts_remove(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before memcache 1.3 there is no batch_write_finish: objects are readable from allocation,
    and an abort removes the object."""

    class OldMemcache(MemcacheStandIn):
        batch_write_finish = None  # type: ignore[assignment]

    standin = OldMemcache(1 << 20, exist_counts_allocated=True)
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        store = memcache_standin_store(0, client=standin)
    assert "no batch_write_finish" in caplog.text
    assert not store.stats().write_finish_api
    session = store.open_write(["a", "b"], 64)
    for key in ("a", "b"):  # the stand-in has no finish: mark them readable as old memcache did
        standin._blobs[key].readable = True
    assert store.lookup(["a"]).tolist() == [False]  # still hidden in this process while pending
    standin.calls.clear()
    store.finish_write(session, np.array([True, False]))
    assert [(c.name, c.args) for c in standin.calls] == [("remove_batch", (("b",),))]
    assert store.lookup(["a", "b"]).tolist() == [True, False]
    store.close()


# -- a client that is down or stalls ------------------------------------------------------------


def test_a_down_client_makes_lookups_miss_and_saves_skip_then_service_resumes(
    standin: MemcacheStandIn,
) -> None:
    store = memcache_standin_store(0, client=standin)
    caches, engine = engine_over(store)
    with engine:
        ids = tokens(2)
        standin.broken.update({"batch_is_exist", "batch_get_key_info", "batch_alloc"})
        assert engine.lookup(ids) == 0
        saved = engine.save(ids, np.arange(4))
        assert saved.count(ChunkStatus.OK) == 0
        stats = engine.stats()
        assert stats.lookup_errors == 1 and stats.store_errors == 1
        assert store.stats().unavailable == 2 and store.stats().codes == {-3019: 2}
        assert standin.objects() == {}
        standin.broken.clear()
        assert engine.save(ids, np.arange(4)).ok
        assert engine.lookup(ids) == len(ids)


def test_a_stalled_call_times_out_as_unavailable(standin: MemcacheStandIn) -> None:
    store = memcache_standin_store(0, client=standin, timeout_s=0.2)
    gate = standin.stall("batch_is_exist")
    with pytest.raises(kvflow.StoreUnavailableError, match=r"did not return within 0\.2 s"):
        store.open_write(["a"], 64)
    assert gate.passed == 0  # the call was still held: the caller did not wait for it
    assert store.stats().pending_writes == 0 and store.stats().unavailable == 1
    gate.set()
    del standin._stalls["batch_is_exist"]
    store._calls.timeout_s = 60.0  # the call that resumes must not time out on a stalled machine
    assert store.open_write(["a"], 64).status.tolist() == [GRANTED]
    store.close()


def test_close_waits_for_copies_in_flight(standin: MemcacheStandIn) -> None:
    store = memcache_standin_store(0, client=standin)
    session = store.open_write(["a"], 64)
    src = registered(store, 64)
    gate = standin.stall("batch_copy")
    failed: list[np.ndarray] = []
    copy = threading.Thread(
        target=lambda: failed.append(
            store.batch_copy(session.addrs, i64(int(src.ctypes.data)), i64(64), Direction.TO_POOL)
        )
    )
    copy.start()
    assert gate.reached.wait(60), "the copy did not start"
    closer = threading.Thread(target=store.close)
    closer.start()
    time.sleep(0.05)  # time for a close that does not wait to finish (and fail the test)
    assert closer.is_alive(), "close() did not wait for the copy in flight"
    assert "batch_write_finish" not in standin.names()
    gate.set()
    closer.join(60)
    copy.join(60)
    assert not closer.is_alive() and not copy.is_alive()
    assert standin.names()[-1] == "batch_write_finish"  # the pending write is aborted after
    assert failed[0].size == 0


def test_memcache_lease_not_found_is_a_plain_miss(
    standin: MemcacheStandIn, store: kvflow.MemcacheStore
) -> None:
    session = store.open_read(["nope"])
    assert session.found.tolist() == [False]
    assert store.stats().lease_failures == 0  # not stored is not a failure
    assert standin.batch_add_lease(["nope"]) == [NOT_FOUND]
    store.close_read(session)
