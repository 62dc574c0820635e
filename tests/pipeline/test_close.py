"""Closing a batch and waiting for it to end: ``close(wait=True)`` (sync) and
``aclose(wait=True)`` wait until none of its copies runs any more, bounded by the engine's
``stop_grace``, and say whether that came. A copy held at a gate the test opens stands for a
straggler: no clock decides what a test sees."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import kvflow
from kvflow.abc import Direction
from kvflow.pipeline.runtime import STRAGGLER_GRACE, stop_grace
from tests.support.caches import make_caches
from tests.support.gates import Gate
from tests.support.waits import wait_until
from tests.support.wrappers import WrappedStore

BS = 16
TOKENS = np.arange(2 * BS)
# a grace of a second (stop_grace), which a copy held at a gate soon outlives; one layer's copy
# at a time, so that exactly one is held
SHORT = kvflow.EngineConfig(
    chunk_blocks=1, prefetch_layers=1, copy_timeout_s=0.05, op_timeout_s=0.5
)


@pytest.fixture
def store() -> Iterator[WrappedStore]:
    store = WrappedStore(kvflow.LocalStore("8MiB"))
    yield store
    store.close()


def held_at(store: WrappedStore, direction: Direction) -> Gate:
    """From now on, ``direction``'s copies wait at the returned gate (for at most its hold)."""
    gate = Gate()
    store.before_copy = lambda d, *a: gate() if d == direction else None
    return gate


def saved_layout(store: WrappedStore) -> kvflow.KVLayout:
    """Three layers, ``TOKENS`` saved from blocks 0 and 1, with the default timeouts: a stall
    of the machine must not fail the set-up of a test about short ones."""
    layout = kvflow.KVLayout.from_tensors(make_caches(3), block_size=BS)
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1)) as e:
        assert e.save(TOKENS, [0, 1]).ok
    return layout


def sync_engine(store: WrappedStore, config: kvflow.EngineConfig) -> kvflow.SyncTransferEngine:
    """An engine over three layers whose pool holds ``TOKENS``."""
    return kvflow.SyncTransferEngine(saved_layout(store), store, config)


async def ends(handle: kvflow.LoadHandle) -> bool:
    """``aclose(wait=True)`` until it says the batch has ended (each try bounded by the grace:
    a stall of the machine may cost one)."""
    for _ in range(30):
        if await handle.aclose(wait=True):
            return True
    return False


def test_the_grace_is_the_straggler_grace_and_one_store_call() -> None:
    cfg = kvflow.EngineConfig(copy_timeout_s=0.5, op_timeout_s=2.0)
    assert stop_grace(cfg) == STRAGGLER_GRACE * 0.5 + 2.0


def test_close_with_wait_of_a_load_that_copies_returns_true(store: WrappedStore) -> None:
    engine = sync_engine(store, kvflow.EngineConfig(chunk_blocks=1))
    handle = engine.start_load([(TOKENS, [6, 7])])
    handle.wait_layer(0, timeout=60)
    assert handle.close(wait=True) is True
    assert handle.done() and store.usage().leases == 0
    assert handle.close(wait=True) is True  # closing again says the same
    engine.close()


def test_close_with_wait_gives_up_on_a_stuck_load_copy_and_says_so(store: WrappedStore) -> None:
    engine = sync_engine(store, SHORT)
    gate = held_at(store, Direction.FROM_POOL)
    handle = engine.start_load([(TOKENS, [6, 7])])
    assert gate.reached.wait(60)  # layer 0's copy runs, held at the gate
    assert handle.close(wait=True) is False
    assert gate.held == 1 and gate.passed == 0  # the copy still runs: the close did not wait
    gate.set()  # the copy returns: the batch ends
    wait_until(lambda: handle.close(wait=True), 60, "the batch to end")
    assert handle.done()
    engine.close()


def test_close_with_wait_gives_up_on_a_stuck_save_copy_and_stores_nothing(
    store: WrappedStore,
) -> None:
    engine = sync_engine(store, dataclasses.replace(SHORT, deferred_saves=False))  # copy now
    gate = held_at(store, Direction.TO_POOL)
    other = np.arange(100, 100 + 2 * BS)
    save = engine.start_save([(other, [2, 3])])
    save.layer_written(0, timeout=60)
    assert gate.reached.wait(60)
    assert save.close(wait=True) is False
    assert gate.held == 1 and gate.passed == 0
    gate.set()
    wait_until(lambda: save.close(wait=True), 60, "the batch to end")
    assert engine.lookup(other, timeout=60) == 0  # a stopped save commits nothing
    engine.close()


def test_close_without_wait_does_not_wait_for_a_stuck_copy(store: WrappedStore) -> None:
    engine = sync_engine(store, SHORT)
    gate = held_at(store, Direction.FROM_POOL)
    handle = engine.start_load([(TOKENS, [6, 7])])
    assert gate.reached.wait(60)
    assert handle.close() is False  # stopped; its copy still runs
    assert gate.passed == 0
    gate.set()
    wait_until(lambda: handle.close(wait=True), 60, "the batch to end")
    engine.close()


def test_close_with_wait_waits_for_a_session_still_opening(store: WrappedStore) -> None:
    engine = sync_engine(store, kvflow.EngineConfig(chunk_blocks=1))
    store.inline_metadata = False  # the open runs on the metadata thread, not on the loop
    opening = threading.Event()
    gate = Gate()
    real = store.inner.open_read

    def slow(keys):  # type: ignore[no-untyped-def]
        opening.set()
        gate.wait()
        return real(keys)

    store.inner.open_read = slow  # type: ignore[method-assign]
    handle = engine.start_load([(TOKENS, [6, 7])])
    assert opening.wait(60)
    answers: list[bool] = []
    closer = threading.Thread(target=lambda: answers.append(handle.close(wait=True)))
    closer.start()
    gate.set()  # the session opens while (or before) the close waits for it
    closer.join(60)
    assert not closer.is_alive() and answers == [True]
    assert handle.done() and store.usage().leases == 0
    engine.close()


def test_close_with_wait_of_a_load_whose_open_failed_returns_true(store: WrappedStore) -> None:
    engine = sync_engine(store, kvflow.EngineConfig(chunk_blocks=1))

    def down(keys):  # type: ignore[no-untyped-def]
        raise kvflow.StoreUnavailableError("pool server is not answering")

    store.inner.open_read = down  # type: ignore[method-assign]
    handle = engine.start_load([(TOKENS, [6, 7])])
    assert handle.close(wait=True) is True  # nothing opened, nothing copied
    engine.close()


async def test_aclose_with_wait_gives_up_on_a_stuck_copy_and_says_so(
    store: WrappedStore,
) -> None:
    layout = saved_layout(store)
    async with kvflow.TransferEngine(layout, store, SHORT) as engine:
        gate = held_at(store, Direction.FROM_POOL)
        handle = await engine.start_load([(TOKENS, [6, 7])])
        assert await asyncio.to_thread(gate.reached.wait, 60)
        assert await handle.aclose(wait=True) is False
        assert gate.held == 1 and gate.passed == 0
        gate.set()
        assert await ends(handle)
        assert handle.done()


async def test_aclose_with_wait_of_a_finished_batch_returns_true(store: WrappedStore) -> None:
    layout = saved_layout(store)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1)) as e:
        handle = await e.start_load([(TOKENS, [6, 7])])
        assert (await handle.wait(timeout=60)).ok
        assert await handle.aclose(wait=True) is True
        assert store.usage().leases == 0
