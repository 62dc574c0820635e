"""Store failures are data: failed chunks are reported whole, nothing waits past its timeout, and
leases and slots come back, also when the caller's task is cancelled."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

import kvflow
from kvflow.abc import Direction, ReadSession, Store, StoreUsage, WriteSession
from kvflow.testing import InstrumentedStore
from tests.support.caches import make_caches
from tests.support.gates import Gate
from tests.support.waits import wait_until_async
from tests.support.wrappers import WrappedStore

BS = 16
CHUNK = 2
LAYERS = 6


def tokens_for(chunks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK * BS)


@pytest.fixture
def setup():
    caches = make_caches(LAYERS)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = WrappedStore(kvflow.LocalStore("16MiB"))
    yield caches, layout, store
    store.close()


async def stored(layout: kvflow.KVLayout, store: WrappedStore, tokens: np.ndarray) -> None:
    """Save ``tokens`` from blocks 0.. with the default timeouts: a stall of the machine must
    not fail the setup of a test about short ones."""
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        assert (await engine.save(tokens, np.arange(len(tokens) // BS))).ok


async def settle(engine: kvflow.TransferEngine, store: WrappedStore) -> StoreUsage:
    """Wait (bounded) until no batch is open, then return the pool's usage."""
    await wait_until_async(
        lambda: not engine._runtime.batches and not engine._runtime.tasks, 60, "no open batch"
    )
    return store.usage()


def fail_chunk_on_layer(
    store: WrappedStore, direction: Direction, layer: int, chunk_base: int, nbytes: int
):
    """Make the copy of ``layer`` report the ranges of the object at ``chunk_base`` as failed."""
    calls = {"n": 0}

    def hook(d, pool, local, sizes):
        if d != direction:
            return None
        k = calls["n"]
        calls["n"] += 1
        if k == layer:
            bad = np.flatnonzero((pool >= chunk_base) & (pool < chunk_base + nbytes))
            store.inner.batch_copy(pool, local, sizes, d)  # the other ranges did move
            return bad
        return None

    store.before_copy = hook


async def test_failed_copy_fails_its_whole_chunk_on_load(setup) -> None:
    caches, layout, store = setup
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        tokens = tokens_for(3)
        assert (await engine.save(tokens, np.arange(6))).ok
        session = store.inner.open_read(engine.plan([(tokens, np.arange(6))], load=True).keys)
        second_chunk_base = int(session.addrs[1])
        store.inner.close_read(session)
        fail_chunk_on_layer(
            store, Direction.FROM_POOL, 3, second_chunk_base, layout.object_bytes(CHUNK)
        )
        result = await engine.load(tokens, np.arange(10, 16))
        req = result.requests[0]
        assert not result.ok
        assert list(req.chunk_status) == [0, int(kvflow.ChunkStatus.FAILED), 0]
        assert sorted(req.failed_block_ids.tolist()) == [12, 13]
        assert req.ok_tokens == CHUNK * BS
        assert engine.stats().failed_chunks == 1
        usage = await settle(engine, store)
        assert usage.leases == 0 and usage.open_sessions == 0


async def test_failed_copy_on_save_never_commits_the_chunk(setup) -> None:
    caches, layout, store = setup
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        tokens = tokens_for(3)
        granted: list[int] = []
        real_open = store.inner.open_write

        def spy(keys, nbytes):
            session = real_open(keys, nbytes)
            granted.extend(int(a) for a in session.addrs)
            return session

        store.inner.open_write = spy  # type: ignore[method-assign]
        calls = {"n": 0}

        def hook(d, pool, local, sizes):
            calls["n"] += 1
            if calls["n"] == 5:  # layer 4 of the save: the first chunk's ranges fail
                return np.flatnonzero((pool >= granted[0]) & (pool < granted[1]))
            return None

        store.before_copy = hook
        result = await engine.save(tokens, np.arange(6))
        assert list(result.requests[0].chunk_status) == [1, 0, 0]
        keys = engine.plan([(tokens, np.arange(6))], load=False).keys
        assert store.inner.lookup(keys).tolist() == [False, True, True]
        assert await engine.lookup(tokens) == 0  # the prefix is broken at chunk 0
        usage = await settle(engine, store)
        assert usage.pending_writes == 0 and usage.objects == 2


async def test_store_error_in_copy_fails_every_chunk_and_releases_leases(setup) -> None:
    caches, layout, store = setup
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        tokens = tokens_for(2)
        await e.save(tokens, np.arange(4))

        def boom(d, *a):
            if d == Direction.FROM_POOL:
                raise kvflow.StoreError("transfer engine lost the segment", code=-800)

        store.before_copy = boom
        result = await e.load(tokens, np.arange(8, 12))
        assert sorted(result.failed_block_ids.tolist()) == [8, 9, 10, 11]
        usage = await settle(e, store)
        assert usage.leases == 0 and usage.open_sessions == 0


async def test_stuck_copy_times_out_and_keeps_its_lease_until_it_returns(setup) -> None:
    caches, layout, store = setup
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, copy_timeout_s=0.2)
    gate = Gate()
    tokens = tokens_for(2)
    await stored(layout, store, tokens)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        store.before_copy = lambda d, *a: gate() if d == Direction.FROM_POOL else None
        result = await asyncio.wait_for(engine.load(tokens, np.arange(8, 12)), 60)
        assert not result.ok and result.count(kvflow.ChunkStatus.FAILED) == 2
        assert gate.passed == 0, "the caller waited for the stuck copy"
        assert engine.stats().timeouts >= 1
        # the copy is still running in its thread: the pool must not reuse what it reads
        assert store.usage().leases == 2
        gate.set()
        usage = await settle(engine, store)
        assert usage.leases == 0 and usage.open_sessions == 0


async def test_a_stuck_source_costs_one_copy_timeout_not_one_per_layer(setup) -> None:
    """Every copy of a load stalls (a source that stopped answering): once the first layer's
    wait ran out and failed every chunk, the later layers are not waited for: one timeout is
    counted, not one per layer, and the stuck copies keep their leases until they return."""
    caches, layout, store = setup
    assert layout.num_layers > 1
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, copy_timeout_s=0.2)
    gate = Gate()
    tokens = tokens_for(2)
    await stored(layout, store, tokens)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        store.before_copy = lambda d, *a: gate() if d == Direction.FROM_POOL else None
        result = await asyncio.wait_for(engine.load(tokens, np.arange(8, 12)), 60)
        assert result.count(kvflow.ChunkStatus.FAILED) == 2
        assert engine.stats().timeouts == 1
        assert store.usage().leases == 2
        gate.set()
        usage = await settle(engine, store)
        assert usage.leases == 0 and usage.open_sessions == 0


async def test_wait_layer_and_layer_written_time_out(setup) -> None:
    caches, layout, store = setup
    gate = Gate()
    # the gate holds the copies while the test runs: their timeout must not end them first
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, save_backlog=1, copy_timeout_s=60)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        tokens = tokens_for(2)
        assert (await engine.save(tokens, np.arange(4))).ok
        store.before_copy = gate
        handle = await engine.start_load([(tokens, np.arange(8, 12))])
        with pytest.raises(kvflow.TransferTimeoutError) as info:
            await handle.wait_layer(0, timeout=0.05)
        assert "layer 0" in str(info.value)
        save = await engine.start_save([(tokens_for(2, seed=9), np.arange(20, 24))])
        await save.layer_written(0)
        with pytest.raises(kvflow.TransferTimeoutError):
            await save.layer_written(1, timeout=0.05)
        gate.set()
        assert (await handle.wait()).ok
        await save.aclose()
        usage = await settle(engine, store)
        assert usage.leases == 0 and usage.pending_writes == 0


async def test_store_down_turns_into_misses_and_failed_chunks(setup) -> None:
    caches, layout, store = setup
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        tokens = tokens_for(2)
        await e.save(tokens, np.arange(4))

        def down(*a, **k):
            raise kvflow.StoreUnavailableError("pool server is not answering")

        store.inner.lookup = down  # type: ignore[method-assign]
        store.inner.open_read = down  # type: ignore[method-assign]
        store.inner.open_write = down  # type: ignore[method-assign]
        assert await e.lookup(tokens) == 0
        assert e.stats().lookup_errors == 1
        result = await e.load(tokens, np.arange(8, 12))
        assert result.count(kvflow.ChunkStatus.FAILED) == 2
        saved = await e.save(tokens_for(2, seed=3), np.arange(4))
        assert saved.count(kvflow.ChunkStatus.FAILED) == 2  # not stored, reported


async def test_metadata_call_that_hangs_times_out(setup) -> None:
    """A store whose metadata crosses a socket (not inline) and hangs: the call times out."""
    caches, layout, store = setup
    store.inline_metadata = False
    gate = Gate()
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, op_timeout_s=0.2)
    tokens = tokens_for(2)
    await stored(layout, store, tokens)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        real = store.inner.open_read
        opened = threading.Event()

        def slow(keys):
            gate.wait()
            try:
                return real(keys)
            finally:
                opened.set()

        store.inner.open_read = slow  # type: ignore[method-assign]
        result = await asyncio.wait_for(engine.load(tokens, np.arange(8, 12)), 60)
        assert result.count(kvflow.ChunkStatus.FAILED) == 2
        assert gate.passed == 0, "the caller waited for the hung open_read"
        gate.set()  # the late open_read returns: its leases must be released by themselves
        await wait_until_async(opened.is_set, 60, "the late open_read to return")

        def released() -> bool:
            usage = store.usage()
            return usage.leases == 0 and usage.open_sessions == 0

        await wait_until_async(released, 60, "the late session to be released")


@pytest.mark.parametrize("op", ["load", "save"])
async def test_cancelling_the_caller_releases_leases_and_slots(setup, op: str) -> None:
    caches, layout, store = setup
    gate = Gate()
    # a cancelled batch waits for its copies up to the copy timeout, and the gate holds this
    # one: 5 s, so the cancellation returns while it is held, and only a stall longer than that
    # between the copy's arrival at the gate and the cancel could let the load end first
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, copy_timeout_s=5)
    async with kvflow.TransferEngine(layout, store, cfg) as e:
        tokens = tokens_for(3)
        await e.save(tokens, np.arange(6))
        before = store.usage()
        copies = {"n": 0}

        def hook(*a):
            copies["n"] += 1
            if copies["n"] == 2:
                gate.wait()  # stall layer 1 so the caller is cancelled mid-batch

        store.before_copy = hook
        if op == "load":
            task = asyncio.ensure_future(e.load(tokens, np.arange(10, 16)))
        else:
            task = asyncio.ensure_future(e.save(tokens_for(3, seed=5), np.arange(6)))
        await wait_until_async(gate.reached.is_set, 60, "layer 1's copy to stall")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)
        # the cancellation ended while the copy was still stuck: it did not wait for it
        assert gate.passed == 0, "cancellation waited for the stuck copy"
        assert store.usage().leases + store.usage().pending_writes > 0  # straggler holds it
        gate.set()
        usage = await settle(e, store)
        assert usage.leases == 0 and usage.pending_writes == 0 and usage.open_sessions == 0
        assert usage.used == before.used and usage.objects == before.objects


async def test_failed_chunk_is_not_copied_again_in_later_layers(setup) -> None:
    caches, layout, store = setup
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, prefetch_layers=1)
    async with kvflow.TransferEngine(layout, store, cfg) as e:
        tokens = tokens_for(1)
        await e.save(tokens, np.arange(2))
        before = [c[8:10].clone() for c in caches]
        calls = {"n": 0}

        def hook(d, pool, *a):
            if d == Direction.FROM_POOL:
                calls["n"] += 1
                if calls["n"] == 1:
                    return np.arange(pool.shape[0])  # layer 0: every range fails
            return None

        store.before_copy = hook
        handle = await e.start_load([(tokens, np.arange(8, 10))])
        for layer in range(LAYERS):  # layer by layer: layer 1 starts after layer 0 failed
            await handle.wait_layer(layer)
        result = await handle.wait()
        assert not result.ok
        assert calls["n"] == 1, "layers after a failure still copied the failed chunk"
        for c, b in zip(caches, before, strict=True):
            assert torch.equal(c[8:10].view(torch.uint8), b.view(torch.uint8))


class _LosesSessions(InstrumentedStore):
    """A real LocalStore whose commit or release reports that the store lost the session (as a
    SharedStore does when its server went away or a lease ran past its limit)."""

    def __init__(self, inner: Store, fail: str) -> None:
        super().__init__(inner)
        self.fail = fail

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        super().finish_write(session, np.zeros_like(ok) if self.fail == "finish_write" else ok)
        if self.fail == "finish_write":
            raise kvflow.StoreUnavailableError("the pool went away before the commit")

    def close_read(self, session: ReadSession) -> None:
        super().close_read(session)
        if self.fail == "close_read":
            raise kvflow.StoreError("the leases ran past their time limit", 3)


@pytest.mark.parametrize("fail", ["finish_write", "close_read"])
async def test_a_session_the_store_lost_fails_its_chunks(fail: str) -> None:
    caches = make_caches(LAYERS)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    inner = kvflow.LocalStore("16MiB")
    store = _LosesSessions(inner, fail="")
    tokens = tokens_for(3)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        if fail == "close_read":
            assert (await e.save(tokens, np.arange(6))).ok
        store.fail = fail
        if fail == "finish_write":
            result = await e.save(tokens, np.arange(6))
            assert await e.lookup(tokens) == 0  # nothing was committed
        else:
            result = await e.load(tokens, np.arange(10, 16))
        assert result.count(kvflow.ChunkStatus.FAILED) == 3 and not result.ok
        stats = e.stats()
        assert stats.store_errors == 1 and stats.failed_chunks == 3
        assert stats.blocks_loaded == 0
        assert stats.blocks_saved == (6 if fail == "close_read" else 0)
    u = inner.usage()
    assert (u.pending_writes, u.leases) == (0, 0)
    inner.close()
