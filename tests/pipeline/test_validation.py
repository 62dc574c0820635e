"""Bad input to the engine's operations is refused before the store is asked anything.

What is tested: a block id repeated among the blocks of one request's full chunks (a save would
store one block's KV for two places of a sequence, a load would write two chunks into one
block) and, for a load, a block shared between requests, refused alike by ``TransferEngine`` and
``SyncTransferEngine``, naming the request, its argument and the repeated ids, with the pool as
it was; and a negative, NaN or infinite ``timeout`` refused by every public wait, async and sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

import kvflow
from kvflow.abc import StoreUsage
from tests.support.caches import make_caches

BS = 16
CHUNK = 2
LAYERS = 3
BAD_TIMEOUTS = [-1.0, -0.5, -1, math.nan, math.inf, "5", True]


def tokens_for(chunks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK * BS)


@pytest.fixture
def layout() -> kvflow.KVLayout:
    return kvflow.KVLayout.from_tensors(make_caches(LAYERS), block_size=BS)


@pytest.fixture
def store() -> Iterator[kvflow.LocalStore]:
    store = kvflow.LocalStore("16MiB")
    yield store
    store.close()


@pytest.fixture
def sync_engine(
    layout: kvflow.KVLayout, store: kvflow.LocalStore
) -> Iterator[kvflow.SyncTransferEngine]:
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        yield e


def assert_untouched(store: kvflow.LocalStore, before: StoreUsage) -> None:
    after = store.usage()
    assert (after.objects, after.used) == (before.objects, before.used)
    assert (after.pending_writes, after.leases, after.open_sessions) == (0, 0, 0)


# -- repeated block ids ----------------------------------------------------------------------


async def test_save_refuses_a_block_repeated_within_a_request(
    layout: kvflow.KVLayout, store: kvflow.LocalStore
) -> None:
    tokens = tokens_for(2)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        before = store.usage()
        requests = [(tokens_for(1, seed=1), [8, 9]), (tokens, [0, 1, 2, 1])]

        with pytest.raises(kvflow.InvalidArgumentError) as info:
            await e.start_save(requests)

        assert info.value.argument == "requests[1].block_ids"
        assert info.value.value == [1]
        assert "requests[1].block_ids=[1]" in str(info.value)
        assert_untouched(store, before)
        assert e.stats().store_metadata_calls == 0 and e.stats().saves == 0
        # the correct save afterwards stores its chunks: nothing wrong was stored before it
        result = await e.save(tokens, [0, 1, 2, 3])
        assert result.count(kvflow.ChunkStatus.OK) == 2


async def test_save_names_every_repeated_id(
    layout: kvflow.KVLayout, store: kvflow.LocalStore
) -> None:
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        with pytest.raises(kvflow.InvalidArgumentError) as info:
            await e.save(tokens_for(3), [7, 3, 5, 7, 3, 3])

        assert info.value.argument == "requests[0].block_ids"
        assert info.value.value == [3, 7]


@pytest.mark.parametrize("load", [False, True])
async def test_a_repeat_outside_the_full_chunks_is_not_refused(
    layout: kvflow.KVLayout, store: kvflow.LocalStore, load: bool
) -> None:
    tokens = tokens_for(2)[: CHUNK * BS + 3]  # one full chunk and a partial block, never moved
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        if load:
            assert (await e.save(tokens, [4, 5, 6])).ok
        op = e.load if load else e.save
        result = await op(tokens, [0, 1, 0])
        assert result.ok and result.requests[0].block_ids.tolist() == [0, 1]


async def test_save_allows_requests_that_share_their_prefix_blocks(
    layout: kvflow.KVLayout, store: kvflow.LocalStore
) -> None:
    """Requests with a common prefix share its blocks (an inference server's prefix cache):
    the same block at the same place of equal token sequences holds the same KV."""
    shared = tokens_for(1, seed=4)
    a = np.concatenate([shared, tokens_for(1, seed=5)])
    b = np.concatenate([shared, tokens_for(1, seed=6)])
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK)
    async with (
        kvflow.TransferEngine(layout, store, cfg) as e,
        await e.start_save([(a, [0, 1, 2, 3]), (b, [0, 1, 4, 5])]) as handle,
    ):
        for layer in range(LAYERS):
            await handle.layer_written(layer)
        result = await handle.wait()

    statuses = [r.chunk_status.tolist() for r in result.requests]
    assert statuses[0] == [kvflow.ChunkStatus.OK] * 2
    assert statuses[1][1] == kvflow.ChunkStatus.OK


async def test_load_refuses_a_block_repeated_within_a_request_like_a_save(
    layout: kvflow.KVLayout, store: kvflow.LocalStore
) -> None:
    tokens = tokens_for(2)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        assert (await e.save(tokens, [0, 1, 2, 3])).ok
        before = store.usage()

        with pytest.raises(kvflow.InvalidArgumentError) as info:
            await e.start_load([(tokens, [10, 11, 12, 11])])

        assert info.value.argument == "requests[0].block_ids"
        assert info.value.value == [11]
        assert "would write two chunks" in info.value.reason
        assert_untouched(store, before)


async def test_load_refuses_a_block_shared_between_requests_naming_both(
    layout: kvflow.KVLayout, store: kvflow.LocalStore
) -> None:
    a, b = tokens_for(1, seed=1), tokens_for(1, seed=2)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        with pytest.raises(kvflow.InvalidArgumentError) as info:
            await e.start_load([(a, [0, 5]), (b, [6, 7]), (b, [5, 0])])

        assert info.value.argument == "requests[2].block_ids"
        assert info.value.value == [0, 5]
        assert "requests[0]" in info.value.reason
        assert "would write two chunks" in info.value.reason


def test_sync_engine_refuses_repeated_blocks_alike(
    sync_engine: kvflow.SyncTransferEngine, store: kvflow.LocalStore
) -> None:
    tokens = tokens_for(2)
    before = store.usage()
    calls = [
        lambda: sync_engine.start_save([(tokens, [0, 1, 2, 1])]),
        lambda: sync_engine.save(tokens, [0, 1, 2, 1]),
        lambda: sync_engine.start_load([(tokens, [0, 1, 2, 1])]),
        lambda: sync_engine.load(tokens, [0, 1, 2, 1]),
    ]
    for call in calls:
        with pytest.raises(kvflow.InvalidArgumentError) as info:
            call()
        assert info.value.argument == "requests[0].block_ids"
        assert info.value.value == [1]
    assert_untouched(store, before)
    assert sync_engine.save(tokens, [0, 1, 2, 3]).count(kvflow.ChunkStatus.OK) == 2


# -- timeouts ---------------------------------------------------------------------------------


def _refused(info: pytest.ExceptionInfo[kvflow.InvalidArgumentError], value: object) -> None:
    assert info.value.argument == "timeout"
    assert info.value.value is value


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_sync_engine_calls_refuse_a_bad_timeout(
    sync_engine: kvflow.SyncTransferEngine, store: kvflow.LocalStore, timeout: object
) -> None:
    tokens = tokens_for(2)
    before = store.usage()
    calls = [
        lambda: sync_engine.lookup(tokens, timeout=timeout),
        lambda: sync_engine.save(tokens, [0, 1, 2, 3], timeout=timeout),
        lambda: sync_engine.load(tokens, [4, 5, 6, 7], timeout=timeout),
        lambda: sync_engine.start_save([(tokens, [0, 1, 2, 3])], timeout=timeout),
    ]
    for call in calls:
        with pytest.raises(kvflow.InvalidArgumentError) as info:
            call()
        _refused(info, timeout)
    assert_untouched(store, before)
    stats = sync_engine.stats()
    assert (stats.lookups, stats.saves, stats.loads) == (0, 0, 0)


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_sync_handles_refuse_a_bad_timeout(
    sync_engine: kvflow.SyncTransferEngine, timeout: object
) -> None:
    tokens = tokens_for(2)
    save = sync_engine.start_save([(tokens, [0, 1, 2, 3])])
    with pytest.raises(kvflow.InvalidArgumentError) as info:
        save.layer_written(0, timeout=timeout)
    _refused(info, timeout)
    for layer in range(LAYERS):  # the refused call claimed nothing
        save.layer_written(layer, timeout=60)
    with pytest.raises(kvflow.InvalidArgumentError) as info:
        save.wait(timeout=timeout)
    _refused(info, timeout)
    assert save.wait(timeout=60).ok
    assert save.wait(timeout=0).ok  # zero is a timeout too: the result is out already

    load = sync_engine.start_load([(tokens, [4, 5, 6, 7])])
    with pytest.raises(kvflow.InvalidArgumentError) as info:
        load.wait_layer(0, timeout=timeout)
    _refused(info, timeout)
    with pytest.raises(kvflow.InvalidArgumentError) as info:
        load.wait(timeout=timeout)
    _refused(info, timeout)
    for layer in range(LAYERS):
        load.wait_layer(layer, timeout=None)  # None: the configured op_timeout_s
    assert load.wait(timeout=None).ok


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
async def test_async_handles_refuse_a_bad_timeout(
    layout: kvflow.KVLayout, store: kvflow.LocalStore, timeout: object
) -> None:
    tokens = tokens_for(2)
    async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        async with await e.start_save([(tokens, [0, 1, 2, 3])]) as save:
            with pytest.raises(kvflow.InvalidArgumentError) as info:
                await save.layer_written(0, timeout=timeout)  # type: ignore[arg-type]
            _refused(info, timeout)
            for layer in range(LAYERS):  # the refused call claimed nothing
                await save.layer_written(layer, timeout=60)
            with pytest.raises(kvflow.InvalidArgumentError) as info:
                await save.wait(timeout=timeout)  # type: ignore[arg-type]
            _refused(info, timeout)
            assert (await save.wait()).ok

        async with await e.start_load([(tokens, [4, 5, 6, 7])]) as load:
            with pytest.raises(kvflow.InvalidArgumentError) as info:
                await load.wait_layer(0, timeout=timeout)  # type: ignore[arg-type]
            _refused(info, timeout)
            with pytest.raises(kvflow.InvalidArgumentError) as info:
                await load.wait(timeout=timeout)  # type: ignore[arg-type]
            _refused(info, timeout)
            assert (await load.wait(timeout=60)).ok
