"""Layerwise ordering: waits follow copies, the prefetch window and save backlog hold, and the
store's metadata calls per batch do not grow with the layer count."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import kvflow
from kvflow.abc import Direction
from tests.support.caches import make_caches
from tests.support.gates import Gate
from tests.support.pools import dispose, make_store
from tests.support.waits import wait_until_async
from tests.support.wrappers import WrappedStore

BS = 16


def tokens_for(chunks: int, chunk_blocks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * chunk_blocks * BS)


@pytest.mark.parametrize("prefetch", [1, 2, 4])
async def test_load_waits_follow_copies_and_window_holds(prefetch: int, store_name: str) -> None:
    layers, chunk_blocks = 12, 2
    caches = make_caches(layers)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = WrappedStore(make_store(store_name, "16MiB"))
    cfg = kvflow.EngineConfig(chunk_blocks=chunk_blocks, prefetch_layers=prefetch)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        tokens = tokens_for(4, chunk_blocks)
        await engine.save(tokens, np.arange(8))
        store.copies.clear()

        copies_started: list[int] = []
        leads: list[int] = []
        handle_box: list[kvflow.LoadHandle] = []

        def before_copy(direction, *_):
            if direction == Direction.FROM_POOL:
                k = len(copies_started)
                copies_started.append(k)
                # layer k may start only once the consumer passed layer k - prefetch
                leads.append(k - handle_box[0].consumed)
                time.sleep(0.0005)

        store.before_copy = before_copy
        handle = await engine.start_load([(tokens, np.arange(20, 28))])
        handle_box.append(handle)
        for layer in range(layers):
            await handle.wait_layer(layer)
            done = [c for c in store.copies if c.direction == Direction.FROM_POOL]
            assert len(done) >= layer + 1, "wait_layer returned before its copy finished"
            # the consumer computes this layer, slower than a copy: every copy the window lets
            # start has started before it goes on (no sleep: a starved copy thread cannot lag)
            window = min(layers, layer + 1 + prefetch)
            await wait_until_async(
                lambda w=window: len(copies_started) >= w,
                60,
                "the window to fill: prefetch did not happen",
            )
        result = await handle.wait()
        assert result.ok
        assert max(leads) < prefetch, leads
        assert max(leads) == prefetch - 1, "the window never filled: prefetch did not happen"
        for layer in range(layers):
            got, want = caches[layer][20:28], caches[layer][0:8]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("backlog", [1, 3])
async def test_save_backlog_bounds_the_producer(backlog: int, store_name: str) -> None:
    layers = 10
    layout = kvflow.KVLayout.from_tensors(make_caches(layers), block_size=BS)
    store = WrappedStore(make_store(store_name, "16MiB"))
    gate = Gate()
    store.before_copy = gate
    cfg = kvflow.EngineConfig(chunk_blocks=2, save_backlog=backlog)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        handle = await engine.start_save([(tokens_for(2, 2), np.arange(4))])
        for layer in range(backlog):
            await handle.layer_written(layer)
        assert handle.backlog == backlog
        blocked = asyncio.ensure_future(handle.layer_written(backlog))
        await asyncio.sleep(0.05)  # time for a producer that does not wait to finish
        assert not blocked.done(), "the producer was not made to wait at a full backlog"
        gate.set()
        await blocked
        seen = []
        for layer in range(backlog + 1, layers):
            await handle.layer_written(layer)
            seen.append(layer + 1 - len(store.copies))  # written, minus copies the store finished
        assert max(seen) <= backlog
        result = await handle.wait()
        assert result.ok
        assert len(store.copies) == layers


async def test_layers_may_be_written_in_any_order_each_once(store_name: str) -> None:
    layout = kvflow.KVLayout.from_tensors(make_caches(5), block_size=BS)
    store = make_store(store_name, "8MiB")
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1)) as engine:
        handle = await engine.start_save([(tokens_for(2, 1), np.arange(2))])
        for layer in (3, 0, 4, 1, 2):  # out of order is allowed, each layer once
            await handle.layer_written(layer)
        result = await handle.wait()
        assert result.ok and all(ev.is_set() for ev in handle.layer_events)
        with pytest.raises(kvflow.InvalidArgumentError) as info:
            await handle.layer_written(1)
        assert info.value.argument == "layer"
    dispose(store)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "metadata-thread"])
@pytest.mark.parametrize("layers", [1, 8, 32, 61])
async def test_metadata_calls_per_batch_do_not_grow_with_layers(
    layers: int, inline: bool, store_name: str
) -> None:
    layout = kvflow.KVLayout.from_tensors(
        make_caches(layers, num_blocks=32, block_shape=(16,), dtype=torch.uint8), block_size=BS
    )
    store = WrappedStore(make_store(store_name, "16MiB"))
    store.inline_metadata = inline
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2)) as engine:
        tokens = tokens_for(8, 2)
        await engine.save(tokens, np.arange(16))
        assert (store.calls["open_write"], store.calls["finish_write"]) == (1, 1)
        assert await engine.lookup(tokens) == len(tokens)
        result = await engine.load(tokens, np.arange(16, 32))
        assert result.ok
    assert store.metadata_calls == 5  # open_write, finish_write, lookup, open_read, close_read
    assert store.calls["batch_copy"] == 2 * layers  # one copy per layer per direction
    assert engine.stats().store_metadata_calls == 5
