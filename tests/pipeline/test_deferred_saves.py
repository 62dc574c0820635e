"""Deferred saves (``EngineConfig.deferred_saves``): a ``SyncTransferEngine`` on host memory whose
store's save may wait (Mooncake, memcache, a wrapper: no inline saves) keeps each written layer
in ``layer_written`` and hands them all to its loop and copy threads after the last one. The
same results as layer by layer: the copies run on the copy thread, a failed copy fails its chunk,
a producer that stops writing fails the batch after ``op_timeout_s``, and a batch closed
meanwhile holds nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvflow
import kvflow.pipeline.handles as handles
from kvflow.results import ChunkStatus
from tests.support.pools import ARENA_STORE_NAMES
from tests.support.waits import wait_until
from tests.support.wrappers import (
    HandClock,
    Parts,
    SaveCopies,
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


@pytest.fixture(params=ARENA_STORE_NAMES)
def parts(request: pytest.FixtureRequest) -> Iterator[Parts]:
    with wrapped_parts(request.param, LAYERS, BS) as made:  # saves_in_memory False
        yield made


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many layers each hand-over of deferred layers to the loop carried."""
    return hand_overs(monkeypatch, "_queue_deferred")


def tokens_for(chunks: int, seed: int = 0) -> np.ndarray:
    return random_tokens(chunks * CHUNK * BS, seed)


def engine(parts: Parts, **cfg: Any) -> kvflow.SyncTransferEngine:
    _, layout, store = parts
    return kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK, **cfg))


def test_the_layers_reach_the_copy_thread_together_after_the_last(
    parts: Parts, hops: list[int]
) -> None:
    caches, _, store = parts
    copies = SaveCopies(store)
    tokens = tokens_for(2)
    with engine(parts) as e:
        with e.start_save([(tokens, np.arange(4))]) as save:
            for layer in range(LAYERS):
                assert copies.seen == []  # nothing handed over before the last layer
                save.layer_written(layer)
            result = save.wait()
        assert result.ok and result.count(ChunkStatus.OK) == 2
        assert len(copies.seen) == LAYERS and threading.get_ident() not in copies.seen
        assert hops == [LAYERS]
        loads_back(e, caches, tokens)
        sync_released(e, store)


def test_off_each_layer_is_copied_as_it_is_written(parts: Parts, hops: list[int]) -> None:
    caches, _, store = parts
    copies = SaveCopies(store)
    tokens = tokens_for(2)
    with engine(parts, deferred_saves=False) as e:
        with e.start_save([(tokens, np.arange(4))]) as save:
            for layer in range(LAYERS):
                save.layer_written(layer)
                wait_until(lambda n=layer + 1: len(copies.seen) == n, 60, "the layer's copy")
            assert save.wait().ok
        assert hops == []
        loads_back(e, caches, tokens)


def test_a_failed_copy_fails_its_own_chunk_only(parts: Parts) -> None:
    _, _, store = parts
    SaveCopies(store, fail={1: [0]})  # layer 1's first range: the first chunk's
    tokens = tokens_for(2)
    with engine(parts) as e:
        result = save_by_layers(e, tokens, np.arange(4), LAYERS)
        assert result.requests[0].chunk_status.tolist() == [ChunkStatus.FAILED, ChunkStatus.OK]
        assert e.lookup(tokens) == 0 and e.engine.stats().failed_chunks == 1
        sync_released(e, store)


def test_a_producer_that_stops_writing_fails_the_batch_and_holds_nothing(parts: Parts) -> None:
    """Two of four layers written, then nothing: the driver gives up ``op_timeout_s`` after the
    last one (nothing was handed over, so nothing was copied) and the slots go back."""
    _, _, store = parts
    copies = SaveCopies(store)
    tokens = tokens_for(2)
    with engine(parts, op_timeout_s=0.5) as e:
        save = e.start_save([(tokens, np.arange(4))], timeout=60)
        save.layer_written(0, timeout=60)
        save.layer_written(1, timeout=60)
        result = save.wait(timeout=60)
        assert result.count(ChunkStatus.FAILED) == 2 and copies.seen == []
        with pytest.raises(kvflow.ClosedError):
            save.layer_written(2, timeout=60)
        sync_released(e, store)
        assert e.lookup(tokens, timeout=60) == 0


def test_a_batch_closed_before_its_last_layer_holds_nothing(parts: Parts) -> None:
    caches, _, store = parts
    copies = SaveCopies(store)
    tokens = tokens_for(2)
    with engine(parts) as e:
        save = e.start_save([(tokens, np.arange(4))])
        save.layer_written(0)
        assert save.close(wait=True) is True
        with pytest.raises(kvflow.ClosedError):
            save.layer_written(1)
        assert copies.seen == []
        sync_released(e, store)
        assert e.lookup(tokens) == 0
        assert e.save(tokens, np.arange(4)).ok  # the engine goes on
        loads_back(e, caches, tokens)


def test_the_backlog_counts_the_layers_kept_until_they_are_copied(parts: Parts) -> None:
    """What the vLLM connector reports as layers still to copy when the forward ends: all of a
    deferred save's until its copies run (an inline save's: none, each copied already)."""
    _, _, store = parts
    tokens = tokens_for(2)
    with engine(parts) as e:
        with e.start_save([(tokens, np.arange(4))], timeout=60) as save:
            for layer in range(LAYERS - 1):
                save.layer_written(layer, timeout=60)
            assert save.handle.backlog == LAYERS - 1
            save.layer_written(LAYERS - 1, timeout=60)
            assert save.wait(timeout=60).ok
            assert save.handle.backlog == 0
        sync_released(e, store)


def test_each_kept_layer_is_word_from_the_producer(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver hears nothing before the last layer: its patience (``op_timeout_s``, by the
    handles' clock) runs from the producer's last layer, so a forward longer than
    ``op_timeout_s`` whose layers each come within it is not failed."""
    caches, _, store = parts
    clock = HandClock()
    monkeypatch.setattr(handles, "time", clock)
    tokens = tokens_for(2)
    with engine(parts, op_timeout_s=2.0) as e:
        with e.start_save([(tokens, np.arange(4))], timeout=60) as save:
            save.layer_written(0, timeout=60)
            clock.now += 1.5
            save.layer_written(1, timeout=60)
            clock.now += 1.5  # 3 s since the first layer, 1.5 since the last
            threading.Event().wait(2.5)  # the driver's first check falls in here
            for layer in range(2, LAYERS):
                save.layer_written(layer, timeout=60)
            assert save.wait(timeout=60).ok
        loads_back(e, caches, tokens)
        sync_released(e, store)
