"""The batch never hangs and never commits a torn object, whatever its caller does."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

import kvflow
from tests.support.caches import make_caches
from tests.support.gates import Gate
from tests.support.waits import wait_until
from tests.support.wrappers import WrappedStore

BS = 16


@pytest.fixture
def parts():
    caches = make_caches(4)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = WrappedStore(kvflow.LocalStore("16MiB"))
    yield caches, layout, store
    store.close()


async def settle(engine: kvflow.TransferEngine, timeout: float = 60) -> None:
    """Wait until no batch is open; ``timeout`` only bounds a hang."""
    deadline = time.monotonic() + timeout
    while engine._runtime.batches or engine._runtime.tasks:
        if time.monotonic() > deadline:
            raise AssertionError(f"batches still open: {engine._runtime.batches}")
        await asyncio.sleep(0.01)


async def test_a_layer_written_twice_at_once_is_refused_and_nothing_is_torn(parts) -> None:
    caches, layout, store = parts
    gate = Gate()
    store.before_copy = gate
    cfg = kvflow.EngineConfig(chunk_blocks=2, save_backlog=1)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        tokens = np.arange(64)
        save = await engine.start_save([(tokens, np.arange(4))])
        await save.layer_written(0)
        first = asyncio.ensure_future(save.layer_written(1))  # waits: the backlog is full
        await asyncio.sleep(0.02)
        with pytest.raises(kvflow.InvalidArgumentError):
            await save.layer_written(1)  # the same layer again, while the first still waits
        gate.set()
        await first
        for layer in (2, 3):
            await save.layer_written(layer)
        assert (await save.wait()).ok
        for c in caches:
            c[10:14].zero_()
        assert (await engine.load(tokens, np.arange(10, 14))).ok
        for c in caches:
            assert torch.equal(c[10:14].view(torch.uint8), c[0:4].view(torch.uint8))


async def test_an_abandoned_save_fails_and_frees_its_slots(parts) -> None:
    caches, layout, store = parts
    cfg = kvflow.EngineConfig(chunk_blocks=2, op_timeout_s=0.2)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        save = await engine.start_save([(np.arange(64), np.arange(4))])
        await save.layer_written(0)  # and then the producer goes away
        # the batch fails by its own op_timeout_s: without it this wait would raise (its bound
        # is only for a hang)
        result = await save.wait(timeout=60)
        assert result.count(kvflow.ChunkStatus.FAILED) == 2
        await settle(engine)
        assert store.usage().pending_writes == 0 and store.usage().used == 0
        assert isinstance(save.last_error, kvflow.TransferTimeoutError)


async def test_an_abandoned_load_fails_and_releases_its_leases(parts) -> None:
    caches, layout, store = parts
    # stored with the default timeouts: a stall of the machine must not fail the setup
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2)) as engine:
        assert (await engine.save(np.arange(64), np.arange(4))).ok
    cfg = kvflow.EngineConfig(chunk_blocks=2, op_timeout_s=0.2, prefetch_layers=1)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        load = await engine.start_load([(np.arange(64), np.arange(10, 14))])
        await load.wait_layer(0, timeout=60)  # then the consumer never comes back
        await asyncio.sleep(0.4)
        await settle(engine)
        assert store.usage().leases == 0
        assert not (await load.wait(timeout=60)).ok


async def test_a_driver_that_fails_fails_the_batch_instead_of_hanging(parts) -> None:
    caches, layout, store = parts
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2)) as e:
        await e.save(np.arange(64), np.arange(4))

        def broken(*a):
            raise RuntimeError("executor is gone")

        e._runtime.copier.submit = broken  # type: ignore[method-assign]
        result = await asyncio.wait_for(e.load(np.arange(64), np.arange(10, 14)), 60)
        assert result.count(kvflow.ChunkStatus.FAILED) == 2
        await settle(e)
        assert store.usage().leases == 0


async def test_cleanup_survives_repeated_cancellation(parts) -> None:
    caches, layout, store = parts
    gate = threading.Event()
    store.inline_metadata = False  # a store whose release crosses a socket, and is slow
    real_close_read = store.inner.close_read

    def slow_close_read(session):
        gate.wait(60)
        real_close_read(session)

    store.inner.close_read = slow_close_read  # type: ignore[method-assign]
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2)) as e:
        await e.save(np.arange(64), np.arange(4))
        handle = await e.start_load([(np.arange(64), np.arange(10, 14))])
        closer = asyncio.ensure_future(handle.aclose())
        for _ in range(3):  # cancel the closer again and again while the release is under way
            await asyncio.sleep(0.01)
            closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        gate.set()
        await settle(e)
        assert store.usage().leases == 0 and store.usage().open_sessions == 0


def test_sync_engines_leave_no_threads_behind() -> None:
    before = threading.active_count()
    layout = kvflow.KVLayout.from_tensors(make_caches(2), block_size=BS)
    store = kvflow.LocalStore("8MiB")
    for i in range(20):
        with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1)) as e:
            e.save(np.arange(32) + i, [0, 1])
            e.load(np.arange(32) + i, [2, 3])
    wait_until(lambda: threading.active_count() <= before, 60, "the engines' threads to end")
    store.close()
