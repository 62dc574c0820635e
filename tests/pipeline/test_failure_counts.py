"""``stats().failed_chunks`` counts every chunk a transfer reports FAILED, once.

What is tested: a store that is down when a batch opens (a closed LocalStore; a shared pool
whose server is stopped) fails every chunk of each load and save, and those chunks are counted,
through the async engine and the sync facade alike; a store that comes back does not count
again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvflow
from kvflow.abc import Store
from tests.support.caches import make_caches
from tests.support.pools import ServedSharedStore, dispose

BS = 16
CHUNK = 2
LAYERS = 3


def tokens_for(chunks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK * BS)


def closed_local() -> tuple[Store, Callable[[], None]]:
    store = kvflow.LocalStore("16MiB")
    return store, store.close


def stopped_server() -> tuple[Store, Callable[[], None]]:
    store = ServedSharedStore(16 << 20)  # a stopped server fails requests at once
    return store, store.stop_server


DOWN = [pytest.param(closed_local, id="closed-local"), pytest.param(stopped_server, id="shared")]


@pytest.fixture(params=DOWN)
def down_store(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Store, Callable[[], None]]]:
    store, take_down = request.param()
    yield store, take_down
    dispose(store)


async def test_chunks_failed_by_a_store_that_is_down_are_counted(
    down_store: tuple[Store, Callable[[], None]],
) -> None:
    store, take_down = down_store
    layout = kvflow.KVLayout.from_tensors(make_caches(LAYERS), block_size=BS)
    tokens = tokens_for(3)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        assert (await e.save(tokens, np.arange(6))).ok
        take_down()

        loaded = await e.load(tokens, np.arange(10, 16))
        saved = await e.save(tokens_for(2, seed=1), np.arange(20, 24))

        assert loaded.count(kvflow.ChunkStatus.FAILED) == 3
        assert saved.count(kvflow.ChunkStatus.FAILED) == 2
        stats = e.stats()
        assert stats.store_errors == 2
        assert stats.failed_chunks == 5
        assert (stats.blocks_loaded, stats.blocks_saved) == (0, 6)


def test_sync_engine_counts_chunks_failed_by_a_store_that_is_down(
    down_store: tuple[Store, Callable[[], None]],
) -> None:
    store, take_down = down_store
    layout = kvflow.KVLayout.from_tensors(make_caches(LAYERS), block_size=BS)
    tokens = tokens_for(3)
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        assert e.save(tokens, np.arange(6)).ok
        take_down()

        load = e.start_load([(tokens, np.arange(10, 16))])
        for layer in range(LAYERS):
            load.wait_layer(layer, timeout=60)
        save = e.start_save([(tokens_for(2, seed=1), np.arange(20, 24))])
        for layer in range(LAYERS):
            save.layer_written(layer, timeout=60)

        assert load.wait(timeout=60).count(kvflow.ChunkStatus.FAILED) == 3
        assert save.wait(timeout=60).count(kvflow.ChunkStatus.FAILED) == 2
        assert e.stats().failed_chunks == 5


async def test_a_failed_copy_is_counted_once_with_a_failed_open() -> None:
    """Chunks failed by a copy and chunks failed by the store's open add up, each once."""
    from tests.support.wrappers import WrappedStore

    layout = kvflow.KVLayout.from_tensors(make_caches(LAYERS), block_size=BS)
    inner = kvflow.LocalStore("16MiB")
    store = WrappedStore(inner)
    tokens = tokens_for(2)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        assert (await e.save(tokens, np.arange(4))).ok
        store.before_copy = lambda d, pool, *a: np.arange(pool.shape[0])  # every range fails
        assert (await e.load(tokens, np.arange(10, 14))).count(kvflow.ChunkStatus.FAILED) == 2
        assert e.stats().failed_chunks == 2
        inner.close()
        assert (await e.load(tokens, np.arange(10, 14))).count(kvflow.ChunkStatus.FAILED) == 2
        assert e.stats().failed_chunks == 4
