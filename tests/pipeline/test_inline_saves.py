"""Inline saves (``EngineConfig.inline_saves``): a ``SyncTransferEngine`` on host memory, with a
store that saves into memory mapped in this process, copies each written layer in
``layer_written`` on the caller's thread and hands the layers to its loop together. The same
results as copies on the copy thread: failed copies fail their chunks, nothing half-written is
visible, a batch that ends while such a copy runs keeps its slots until it returns, and a long
forward does not look silent to the batch's driver."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvflow
import kvflow.pipeline.handles as handles
from kvflow.abc import Direction
from kvflow.errors import StoreError
from kvflow.results import ChunkStatus
from tests.support.pools import ARENA_STORE_NAMES
from tests.support.waits import wait_until
from tests.support.wrappers import (
    HandClock,
    Parts,
    SaveCopies,
    WrappedStore,
    hand_overs,
    loads_back,
    random_tokens,
    save_by_layers,
    sync_released,
    wrapped_parts,
)

BS = 16
CHUNK = 2
LAYERS = 4
HOLD_S = 60.0  # a held copy waits this long at most: the tests let it go themselves


@pytest.fixture(params=ARENA_STORE_NAMES)
def parts(request: pytest.FixtureRequest) -> Iterator[Parts]:
    with wrapped_parts(request.param, LAYERS, BS, inline=True) as made:
        yield made


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many layers each hand-over of copied layers to the loop carried."""
    return hand_overs(monkeypatch, "_queue_copied")


def tokens_for(chunks: int, seed: int = 0) -> np.ndarray:
    return random_tokens(chunks * CHUNK * BS, seed)


def engine(layout: kvflow.KVLayout, store: WrappedStore, **cfg: Any) -> kvflow.SyncTransferEngine:
    return kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK, **cfg))


def test_each_layer_is_copied_before_layer_written_returns_on_the_callers_thread(
    parts: Parts, hops: list[int]
) -> None:
    caches, layout, store = parts
    copies = SaveCopies(store)
    tokens = tokens_for(2)
    with engine(layout, store) as e:
        with e.start_save([(tokens, np.arange(4))]) as save:
            for layer in range(LAYERS):
                save.layer_written(layer)
                assert len(copies.seen) == layer + 1  # copied already
                assert save.handle.backlog == 0  # nothing left to copy
            result = save.wait()
        assert result.ok and result.count(ChunkStatus.OK) == 2
        assert copies.seen == [threading.get_ident()] * LAYERS
        assert hops == [LAYERS]  # one hop to the loop, after the last layer
        loads_back(e, caches, tokens)
        sync_released(e, store)


@pytest.mark.parametrize("why", ["off", "store"])
def test_saves_go_to_the_copy_thread_when_off_or_when_the_store_may_wait(
    parts: Parts, why: str
) -> None:
    caches, layout, store = parts
    if why == "store":
        store.saves_in_memory = False  # as a store whose copy crosses a socket
    copies = SaveCopies(store)
    tokens = tokens_for(2)
    with engine(layout, store, inline_saves=why != "off") as e:
        assert save_by_layers(e, tokens, np.arange(4), LAYERS).ok
        assert len(copies.seen) == LAYERS
        assert threading.get_ident() not in copies.seen
        loads_back(e, caches, tokens)


def test_a_failed_inline_copy_fails_its_own_chunk_only(parts: Parts) -> None:
    caches, layout, store = parts
    SaveCopies(store, fail={1: [0]})  # layer 1's first range: the first chunk's
    tokens = tokens_for(2)
    with engine(layout, store) as e:
        result = save_by_layers(e, tokens, np.arange(4), LAYERS)
        assert result.requests[0].chunk_status.tolist() == [ChunkStatus.FAILED, ChunkStatus.OK]
        assert e.lookup(tokens) == 0  # a prefix's first chunk lost: nothing of it hits
        assert e.engine.stats().failed_chunks == 1
        sync_released(e, store)


def test_an_inline_copy_that_raises_fails_the_layers_chunks_and_the_caller_goes_on(
    parts: Parts,
) -> None:
    caches, layout, store = parts
    SaveCopies(store, fail={2: StoreError("the copy could not start")})
    tokens = tokens_for(2)
    with engine(layout, store) as e:
        with e.start_save([(tokens, np.arange(4))]) as save:
            for layer in range(LAYERS):
                save.layer_written(layer)  # a store failure is data: not raised here
            result = save.wait()
        assert result.count(ChunkStatus.FAILED) == 2 and e.lookup(tokens) == 0
        store.before_copy = lambda *a: None
        assert e.save(tokens, np.arange(4)).ok  # nothing of the failed batch is left over
        loads_back(e, caches, tokens)
        sync_released(e, store)


def test_a_batch_closed_while_its_inline_copy_runs_keeps_its_slots_until_the_copy_returns(
    parts: Parts,
) -> None:
    """The copy is the producer's, on its thread: the batch closed from another thread must
    not give the pool back the slots that copy still writes into."""
    caches, layout, store = parts
    held, gate = threading.Event(), threading.Event()

    def stall(direction: Direction, *args: Any) -> None:
        if direction == Direction.TO_POOL:
            held.set()
            gate.wait(HOLD_S)

    tokens = tokens_for(2)
    errors: list[BaseException] = []
    with engine(layout, store, copy_timeout_s=1.0) as e:  # a straggler's grace: 10 s
        save = e.start_save([(tokens, np.arange(4))])
        store.before_copy = stall

        def producer() -> None:
            try:
                save.layer_written(0)
            except kvflow.KVFlowError as exc:
                errors.append(exc)

        thread = threading.Thread(target=producer)
        thread.start()
        try:
            assert held.wait(HOLD_S)
            assert save.close() is False  # stopped; it waited the copy's timeout, in vain
            assert store.usage().pending_writes == 2  # the slots stay while the copy runs
            assert not save.done()
        finally:
            gate.set()
            thread.join(HOLD_S)
        assert not thread.is_alive() and len(errors) == 1
        assert isinstance(errors[0], kvflow.ClosedError)
        sync_released(e, store)  # given back once the copy returned
        store.before_copy = lambda *a: None
        assert e.lookup(tokens) == 0  # nothing half-written became visible
        assert e.save(tokens, np.arange(4)).ok


@pytest.mark.parametrize("silent", [False, True])
def test_the_driver_waits_for_a_producer_that_copies_and_fails_one_that_is_silent(
    parts: Parts, hops: list[int], monkeypatch: pytest.MonkeyPatch, silent: bool
) -> None:
    """Inline layers reach the driver after the last one: a forward longer than
    ``op_timeout_s`` must not fail the batch while its layers are being copied, and a producer
    that stops for ``op_timeout_s`` (by the handles' clock) must, as through the copy thread."""
    caches, layout, store = parts
    clock = HandClock()
    monkeypatch.setattr(handles, "time", clock)
    tokens = tokens_for(2)
    with engine(layout, store, op_timeout_s=2.0) as e:
        with e.start_save([(tokens, np.arange(4))], timeout=HOLD_S) as save:
            save.layer_written(0, timeout=HOLD_S)
            if silent:
                clock.now += 2.0  # the producer's last copy was op_timeout_s ago
                wait_until(save.done, HOLD_S, "the driver to give up on a silent producer")
                with pytest.raises(kvflow.ClosedError):
                    save.layer_written(1, timeout=HOLD_S)
                assert save.wait(timeout=HOLD_S).count(ChunkStatus.FAILED) == 2
            else:
                time.sleep(2.5)  # past the driver's op_timeout_s: the producer is still on time
                for layer in range(1, LAYERS):
                    save.layer_written(layer, timeout=HOLD_S)
                assert save.wait(timeout=HOLD_S).ok
        assert hops == ([] if silent else [LAYERS])
        if not silent:
            loads_back(e, caches, tokens)
        sync_released(e, store)
