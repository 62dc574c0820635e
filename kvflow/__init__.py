"""kvflow: move LLM KV cache between device memory and a shared pool, layer by layer.

import kvflow

layout = kvflow.KVLayout.from_tensors(kv_caches, block_size=16)
store = kvflow.LocalStore("8GiB")
async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(model="m")) as engine:
    await engine.save(token_ids, block_ids)
    hit = await engine.lookup(token_ids)
    request = kvflow.BlockRequest(token_ids[:hit], block_ids[: hit // 16])
    async with await engine.start_load([request]) as load:
        for layer in range(layout.num_layers):
            await load.wait_layer(layer)  # layer i is in device memory; compute it
        result = await load.wait()        # leaving early (error, cancellation) aborts the load

Store implementers find their interface in ``kvflow.abc``; test tools are in ``kvflow.testing``.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kvflow.config import EngineConfig, spare_cpus
from kvflow.errors import (
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    KVFlowError,
    LayoutError,
    MissingDependencyError,
    PoolRefusedError,
    StoreError,
    StoreUnavailableError,
    TransferTimeoutError,
)
from kvflow.keys import ChunkHashes
from kvflow.layout import SKIP_BLOCK, KVLayout
from kvflow.results import ChunkStatus, RequestResult, TransferResult
from kvflow.stats import EngineStats

# Imported when first used (PEP 562): the engine pulls in torch, which a process that only
# runs the pool server (``kvflow serve``, started by a client when the pool is gone) or only
# uses a store does not need; a server started a second sooner is a second fewer of misses.
_LAZY = {
    "BlockRequest": "kvflow.pipeline.batch",
    "LoadHandle": "kvflow.pipeline",
    "SaveHandle": "kvflow.pipeline",
    "SyncLoadHandle": "kvflow.pipeline",
    "SyncSaveHandle": "kvflow.pipeline",
    "SyncTransferEngine": "kvflow.pipeline",
    "TransferEngine": "kvflow.pipeline",
    "SharedStore": "kvflow.pool.store",
    "SharedStoreConfig": "kvflow.pool.config",
    "LocalStore": "kvflow.stores",
    "MemcacheConfig": "kvflow.stores",
    "MemcacheStore": "kvflow.stores",
    "MooncakeConfig": "kvflow.stores",
    "MooncakeMaster": "kvflow.stores",
    "MooncakeStore": "kvflow.stores",
}

if TYPE_CHECKING:
    from kvflow.pipeline import (
        LoadHandle,
        SaveHandle,
        SyncLoadHandle,
        SyncSaveHandle,
        SyncTransferEngine,
        TransferEngine,
    )
    from kvflow.pipeline.batch import BlockRequest
    from kvflow.pool.config import SharedStoreConfig
    from kvflow.pool.store import SharedStore
    from kvflow.stores import (
        LocalStore,
        MemcacheConfig,
        MemcacheStore,
        MooncakeConfig,
        MooncakeMaster,
        MooncakeStore,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


try:
    __version__ = version("kvflow")  # pyproject.toml's, as installed
except PackageNotFoundError:  # the sources without an install (on sys.path by hand)
    __version__ = "0+unknown"

__all__ = [
    "BlockRequest",
    "ChunkStatus",
    "ClosedError",
    "ConfigError",
    "EngineConfig",
    "EngineStats",
    "InvalidArgumentError",
    "KVFlowError",
    "KVLayout",
    "ChunkHashes",
    "LayoutError",
    "LoadHandle",
    "LocalStore",
    "MemcacheConfig",
    "MemcacheStore",
    "MissingDependencyError",
    "MooncakeConfig",
    "MooncakeMaster",
    "MooncakeStore",
    "PoolRefusedError",
    "SKIP_BLOCK",
    "RequestResult",
    "SaveHandle",
    "SharedStore",
    "SharedStoreConfig",
    "StoreError",
    "StoreUnavailableError",
    "SyncLoadHandle",
    "SyncSaveHandle",
    "SyncTransferEngine",
    "TransferEngine",
    "TransferResult",
    "TransferTimeoutError",
    "__version__",
    "spare_cpus",
]
