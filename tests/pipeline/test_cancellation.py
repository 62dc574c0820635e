"""A task cancelled while it waits on a bare handle (``wait_layer``, ``layer_written``,
``wait``) aborts the batch: leases, pending writes, copy slots and permits come back at once,
nothing half-written becomes visible, nothing is logged, and the engine goes on. Leaving
``async with handle`` finishes a batch that can end on its own and aborts any other."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import kvflow
from kvflow.abc import Direction, StoreUsage
from tests.support.pools import ARENA_STORE_NAMES
from tests.support.wrappers import Parts, WrappedStore, wrapped_parts

BS = 16
CHUNK = 2
LAYERS = 4
# How long ``released`` polls: only a bound on a hang, far above a stall of the machine. A batch
# left running (not aborted) is not told by the time its release takes: op_timeout_s stays at
# its default (30 s), and the timeout that would end such a batch logs a warning, which the
# tests' ``quiet(caplog)`` refuses.
RELEASE_BOUND_S = 60.0
HOLD_S = 60.0  # a held copy waits this long at most: the tests let it go themselves


@pytest.fixture(params=ARENA_STORE_NAMES)
def parts(request: pytest.FixtureRequest) -> Iterator[Parts]:
    with wrapped_parts(request.param, LAYERS, BS) as made:
        yield made


def tokens_for(chunks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK * BS)


class Stall:
    """Counts the copies of one direction and holds the ``nth`` (from 0) until ``gate``."""

    def __init__(self, store: WrappedStore, direction: Direction, nth: int) -> None:
        self.direction = direction
        self.nth = nth
        self.copies = 0
        self.held = threading.Event()
        self.gate = threading.Event()
        store.before_copy = self

    def __call__(self, direction: Direction, *args: Any) -> None:
        if direction != self.direction:
            return
        nth, self.copies = self.copies, self.copies + 1
        if nth == self.nth:
            self.held.set()
            self.gate.wait(HOLD_S)

    async def reached(self) -> None:
        deadline = time.monotonic() + HOLD_S
        while not self.held.is_set():
            if time.monotonic() > deadline:
                raise AssertionError("the stalled copy never started")
            await asyncio.sleep(0.005)


async def cancel(
    task: asyncio.Task[Any],
    handle: kvflow.LoadHandle | kvflow.SaveHandle,
    stall: Stall | None = None,
) -> None:
    """Cancel ``task`` and see it end cancelled. A held copy is let go once the batch has
    been aborted (or after HOLD_S, if it never is), so that copies queued behind it could
    start only if the abort left them queued."""
    task.cancel()
    if stall is not None:
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            if handle._failed.all():
                break
            await asyncio.sleep(0.01)
        stall.gate.set()
    done, _ = await asyncio.wait([task], timeout=60)
    assert task in done and task.cancelled()


async def released(engine: kvflow.TransferEngine, store: WrappedStore) -> StoreUsage:
    """The pool's usage once the engine holds nothing, polled for at most RELEASE_BOUND_S."""
    deadline = time.monotonic() + RELEASE_BOUND_S
    while True:
        usage = store.usage()
        rt = engine._runtime
        idle = not rt.batches and not rt.tasks and rt.copier.in_flight == 0
        if (idle and usage.leases == 0 and usage.pending_writes == 0) or (
            time.monotonic() > deadline
        ):
            break
        await asyncio.sleep(0.01)
    assert (usage.leases, usage.pending_writes, usage.open_sessions) == (0, 0, 0), usage
    assert not engine._runtime.batches and not engine._runtime.tasks, repr(engine)
    assert engine._runtime.copier.in_flight == 0, repr(engine)
    return usage


async def still_works(engine: kvflow.TransferEngine, caches: list[torch.Tensor]) -> None:
    tokens = tokens_for(2, seed=77)
    assert (await engine.save(tokens, np.arange(20, 24))).ok
    for c in caches:
        c[30:34].zero_()
    assert (await engine.load(tokens, np.arange(30, 34))).ok
    for c in caches:
        assert torch.equal(c[30:34].view(torch.uint8), c[20:24].view(torch.uint8))


def quiet(caplog: pytest.LogCaptureFixture) -> None:
    """No warning, error or traceback was logged."""
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]


def aborted(handle: kvflow.LoadHandle | kvflow.SaveHandle, chunks: int) -> None:
    result = handle.result_now()
    assert result is not None and result.count(kvflow.ChunkStatus.FAILED) == chunks


async def test_a_cancelled_wait_layer_aborts_the_load(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    caches, layout, store = parts
    caplog.set_level(logging.WARNING)
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, prefetch_layers=1)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        tokens = tokens_for(2)
        assert (await engine.save(tokens, np.arange(4))).ok
        stall = Stall(store, Direction.FROM_POOL, 1)
        load = await engine.start_load([(tokens, np.arange(10, 14))])

        async def consume() -> None:
            for layer in range(LAYERS):
                await load.wait_layer(layer)

        task = asyncio.ensure_future(consume())
        await stall.reached()  # the consumer waits for layer 1, whose copy is held
        await cancel(task, load, stall)
        await released(engine, store)
        assert stall.copies == 2  # no layer after the cancelled wait was copied
        aborted(load, 2)
        await still_works(engine, caches)
    quiet(caplog)


async def test_a_cancelled_layer_written_aborts_the_save(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    caches, layout, store = parts
    caplog.set_level(logging.WARNING)
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, save_backlog=1)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        before = store.usage()
        tokens = tokens_for(2)
        stall = Stall(store, Direction.TO_POOL, 0)
        save = await engine.start_save([(tokens, np.arange(4))])

        async def produce() -> None:
            for layer in range(LAYERS):
                await save.layer_written(layer)

        task = asyncio.ensure_future(produce())
        await stall.reached()  # layer 0's copy is held: layer 1 waits for a backlog slot
        assert save.backlog == 1
        await cancel(task, save, stall)
        usage = await released(engine, store)
        assert (usage.objects, usage.used) == (before.objects, before.used)
        assert await engine.lookup(tokens) == 0  # nothing half-written is visible
        aborted(save, 2)
        await still_works(engine, caches)
    quiet(caplog)


async def test_a_cancelled_wait_aborts_the_save(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    caches, layout, store = parts
    caplog.set_level(logging.WARNING)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        before = store.usage()
        tokens = tokens_for(2)
        save = await e.start_save([(tokens, np.arange(4))])
        waiting = asyncio.Event()

        async def produce_some() -> None:
            await save.layer_written(0)
            await save.layer_written(1)
            waiting.set()
            await save.wait()  # the other layers never come

        task = asyncio.ensure_future(produce_some())
        await waiting.wait()
        await cancel(task, save)
        usage = await released(e, store)
        assert (usage.objects, usage.used) == (before.objects, before.used)
        assert await e.lookup(tokens) == 0
        aborted(save, 2)
        await still_works(e, caches)
    quiet(caplog)


async def test_a_cancelled_wait_aborts_the_load(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    caches, layout, store = parts
    caplog.set_level(logging.WARNING)
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, prefetch_layers=1, copy_threads=1)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        tokens = tokens_for(2)
        assert (await engine.save(tokens, np.arange(4))).ok
        stall = Stall(store, Direction.FROM_POOL, 1)
        load = await engine.start_load([(tokens, np.arange(10, 14))])
        task = asyncio.ensure_future(load.wait())  # lifts the prefetch window
        await stall.reached()  # layer 1's copy is held; later ones wait for the copy thread
        await cancel(task, load, stall)
        await released(engine, store)
        assert stall.copies == 2  # the layers queued behind the held copy never ran
        aborted(load, 2)
        await still_works(engine, caches)
    quiet(caplog)


async def test_leaving_async_with_after_every_layer_finishes_the_batch(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    caches, layout, store = parts
    caplog.set_level(logging.WARNING)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        tokens = tokens_for(2)
        async with await e.start_save([(tokens, np.arange(4))]) as save:
            for layer in range(LAYERS):
                await save.layer_written(layer)
        assert save.done()  # no wait(): leaving the block saw the save through
        result = save.result_now()
        assert result is not None and result.ok
        assert await e.lookup(tokens) == len(tokens)
        async with await e.start_load([(tokens, np.arange(10, 14))]) as load:
            for layer in range(LAYERS):
                await load.wait_layer(layer)
        assert load.done()
        result = load.result_now()
        assert result is not None and result.ok
        for c in caches:
            assert torch.equal(c[10:14].view(torch.uint8), c[0:4].view(torch.uint8))
        await released(e, store)
    quiet(caplog)


async def test_leaving_async_with_early_aborts_the_batch(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    caches, layout, store = parts
    caplog.set_level(logging.WARNING)
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, prefetch_layers=1)
    async with kvflow.TransferEngine(layout, store, cfg) as e:
        tokens = tokens_for(2)
        assert (await e.save(tokens, np.arange(4))).ok
        before = store.usage()
        async with await e.start_load([(tokens, np.arange(10, 14))]) as load:
            await load.wait_layer(0)  # the consumer needs no more
        async with await e.start_save([(tokens_for(2, seed=3), np.arange(4))]) as save:
            await save.layer_written(0)  # the producer stops early
        usage = await released(e, store)
        assert (usage.objects, usage.used) == (before.objects, before.used)
        aborted(load, 2)
        aborted(save, 2)
    quiet(caplog)


# -- the blocking facade: a wait that times out leaves the batch going; leaving `with` ends it


def sync_released(engine: kvflow.SyncTransferEngine, store: WrappedStore) -> StoreUsage:
    """``released`` for a SyncTransferEngine, from the caller's thread."""
    return asyncio.run_coroutine_threadsafe(released(engine.engine, store), engine._loop).result(
        RELEASE_BOUND_S + 1
    )


def test_a_sync_wait_that_times_out_says_its_own_timeout(parts: Parts) -> None:
    caches, layout, store = parts
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        tokens = tokens_for(2)
        assert e.save(tokens, np.arange(4)).ok
        stall = Stall(store, Direction.FROM_POOL, 0)
        with e.start_load([(tokens, np.arange(10, 14))]) as load:
            with pytest.raises(kvflow.TransferTimeoutError) as info:
                load.wait(timeout=0.05)
            assert info.value.timeout_s == 0.05 and "LoadHandle.wait" in str(info.value)
            stall.gate.set()
            assert load.wait(timeout=60).ok  # the timeout left the batch going


def test_a_sync_wait_is_not_cut_short_by_a_busy_loop(parts: Parts) -> None:
    """A wait that outlives its timeout while the loop thread is busy leaves the batch going,
    as a wait that times out on a free loop does: no trip through the loop decides it."""
    caches, layout, store = parts
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        tokens = tokens_for(2)
        assert e.save(tokens, np.arange(4)).ok
        stall = Stall(store, Direction.FROM_POOL, 0)
        with e.start_load([(tokens, np.arange(10, 14))]) as load:
            assert load.handle.num_layers == LAYERS  # open before the loop gets busy
            busy = threading.Event()
            e._loop.call_soon_threadsafe(busy.wait, 60)
            with pytest.raises(kvflow.TransferTimeoutError):
                load.wait(timeout=0.05)
            time.sleep(1.2)  # past the margin a trip through the loop would have been given
            busy.set()
            stall.gate.set()
            assert load.wait(timeout=60).ok


def test_leaving_a_sync_with_after_every_layer_finishes_the_batch(parts: Parts) -> None:
    caches, layout, store = parts
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        tokens = tokens_for(2)
        with e.start_save([(tokens, np.arange(4))]) as save:
            for layer in range(LAYERS):
                save.layer_written(layer)
        assert save.done()  # no wait(): leaving the block saw the save through
        assert e.lookup(tokens) == len(tokens)
        with e.start_load([(tokens, np.arange(10, 14))]) as load:
            for layer in range(LAYERS):
                load.wait_layer(layer)
        assert load.done()
        result = load.handle.result_now()
        assert result is not None and result.ok
        for c in caches:
            assert torch.equal(c[10:14].view(torch.uint8), c[0:4].view(torch.uint8))
        sync_released(e, store)


def give_up(e: kvflow.SyncTransferEngine, op: str, stored: np.ndarray, fresh: np.ndarray) -> None:
    """``op`` with a short timeout while the batch's first copy is held."""
    if op == "wait_layer":
        with e.start_load([(stored, np.arange(10, 14))]) as load:
            load.wait_layer(0, timeout=0.05)
    elif op == "layer_written":
        with e.start_save([(fresh, np.arange(4))]) as save:
            save.layer_written(0)
            save.layer_written(1, timeout=0.05)  # the backlog is full
    elif op == "wait":
        with e.start_save([(fresh, np.arange(4))]) as save:
            save.layer_written(0)
            save.wait(timeout=0.05)
    elif op == "load":
        e.load(stored, np.arange(10, 14), timeout=0.05)
    else:
        e.save(fresh, np.arange(4), timeout=0.05)


@pytest.mark.parametrize("op", ["wait_layer", "layer_written", "wait", "load", "save"])
def test_a_sync_caller_that_gives_up_after_a_timeout_holds_nothing(
    parts: Parts, caplog: pytest.LogCaptureFixture, op: str
) -> None:
    """A timed-out wait on a handle, then leaving its ``with``; a whole-request ``load`` or
    ``save`` past its timeout: leases and pending writes come back once the held copy returns,
    silently, and the engine goes on."""
    caches, layout, store = parts
    caplog.set_level(logging.WARNING)
    before = store.usage()
    tokens = tokens_for(2)
    # stored with the default timeouts: a stall of the machine must not fail the setup
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        assert e.save(tokens, np.arange(4)).ok
    cfg = kvflow.EngineConfig(  # each layer to the copy thread: layer_written can wait
        chunk_blocks=CHUNK, save_backlog=1, copy_timeout_s=0.5, deferred_saves=False
    )
    with kvflow.SyncTransferEngine(layout, store, cfg) as e:
        fresh = tokens_for(2, seed=11)
        direction = Direction.FROM_POOL if op in ("wait_layer", "load") else Direction.TO_POOL
        stall = Stall(store, direction, 0)
        with pytest.raises(kvflow.TransferTimeoutError):
            give_up(e, op, tokens, fresh)
        stall.gate.set()
        usage = sync_released(e, store)
        assert usage.objects == before.objects + 2 and e.lookup(fresh) == 0
        assert e.load(tokens, np.arange(10, 14)).ok
    quiet(caplog)
