"""Bad input raises a typed error naming the argument, and leaves the pool unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import kvflow
from tests.support.caches import make_caches
from tests.support.wrappers import WrappedStore

BS = 16


@pytest.fixture
async def engine_and_store():
    layout = kvflow.KVLayout.from_tensors(make_caches(4), block_size=BS)
    store = WrappedStore(kvflow.LocalStore("8MiB"))
    engine = kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2))
    tokens = np.arange(64)
    await engine.save(tokens, np.arange(4))
    yield engine, store
    await engine.close()
    store.close()


BAD_REQUESTS = [
    ("requests[0].block_ids", (np.arange(64), np.arange(3))),  # 64 tokens need 4 blocks
    ("requests[0].block_ids", (np.arange(64), [0, 1, 2, 64])),  # out of range
    ("requests[0].block_ids", (np.arange(64), [0, 1, 2, -2])),
    ("requests[0].block_ids", (np.arange(64), [0.0, 1.0, 2.0, 3.0])),
    ("requests[0].token_ids", (np.arange(64) - 1, np.arange(4))),  # negative token
    ("requests[0].token_ids", (np.ones(64) * 0.5, np.arange(4))),
    ("requests[0].token_ids", (np.ones((8, 8), dtype=np.int64), np.arange(4))),
    ("requests[0]", (np.arange(64),)),
]


@pytest.mark.parametrize("op", ["start_load", "start_save"])
@pytest.mark.parametrize(("argument", "request_"), BAD_REQUESTS)
async def test_bad_request_is_refused_before_the_store_is_touched(
    engine_and_store, op, argument, request_
) -> None:
    engine, store = engine_and_store
    calls, usage = dict(store.calls), store.usage()
    with pytest.raises(kvflow.InvalidArgumentError) as info:
        await getattr(engine, op)([request_])
    assert info.value.argument == argument
    assert argument in str(info.value)
    assert store.calls == calls and store.usage() == usage


async def test_load_into_the_same_block_twice_is_refused(engine_and_store) -> None:
    engine, store = engine_and_store
    usage = store.usage()
    with pytest.raises(kvflow.InvalidArgumentError) as info:
        await engine.start_load([(np.arange(64), [5, 6, 5, 7])])
    assert info.value.argument == "requests[0].block_ids" and info.value.value == [5]
    assert store.usage() == usage


async def test_layer_index_out_of_range(engine_and_store) -> None:
    engine, store = engine_and_store
    handle = await engine.start_load([(np.arange(64), np.arange(10, 14))])
    for bad in (-1, 4, 1.5, True):
        with pytest.raises(kvflow.InvalidArgumentError) as info:
            await handle.wait_layer(bad)
        assert info.value.argument == "layer"
    await handle.aclose()
    save = await engine.start_save([(np.arange(32), np.arange(20, 22))])
    with pytest.raises(kvflow.InvalidArgumentError):
        await save.layer_written(7)
    await save.aclose()


async def test_use_after_close(engine_and_store) -> None:
    engine, store = engine_and_store
    handle = await engine.start_load([(np.arange(64), np.arange(10, 14))])
    await handle.aclose()
    with pytest.raises(kvflow.ClosedError):
        await handle.wait_layer(0)
    await engine.close()
    for call in (
        engine.lookup(np.arange(64)),
        engine.load(np.arange(64), np.arange(4)),
        engine.save(np.arange(64), np.arange(4)),
    ):
        with pytest.raises(kvflow.ClosedError):
            await call


async def test_wrong_layout_inputs_are_layout_errors() -> None:
    import torch

    with pytest.raises(kvflow.LayoutError) as info:
        kvflow.TransferEngine(
            kvflow.KVLayout.from_tensors([torch.zeros(4, 8).t()], block_size=4),
            kvflow.LocalStore("1MiB"),
        )
    assert "stride" in info.value.argument


def test_errors_share_one_base() -> None:
    for exc in (
        kvflow.InvalidArgumentError,
        kvflow.ConfigError,
        kvflow.LayoutError,
        kvflow.ClosedError,
        kvflow.TransferTimeoutError,
        kvflow.StoreError,
        kvflow.StoreUnavailableError,
        kvflow.MissingDependencyError,
    ):
        assert issubclass(exc, kvflow.KVFlowError)
    assert issubclass(kvflow.TransferTimeoutError, TimeoutError)
    assert issubclass(kvflow.InvalidArgumentError, ValueError)
    assert kvflow.StoreError("put failed", code=-704).code == -704
