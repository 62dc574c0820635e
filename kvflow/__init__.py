"""kvflow: move LLM KV cache between device memory and a shared pool, layer by layer.

import kvflow

layout = kvflow.KVLayout.from_tensors(kv_caches, block_size=16)
store = kvflow.LocalStore("8GiB")
async with kvflow.TransferEngine(layout, store, kvflow.EngineConfig(model="m")) as engine:
    await engine.save(token_ids, block_ids)
    hit = await engine.lookup(token_ids)
    async with await engine.start_load([(token_ids[:hit], block_ids[: hit // 16])]) as load:
        for layer in range(layout.num_layers):
            await load.wait_layer(layer)  # layer i is in device memory; compute it
        result = await load.wait()        # leaving early (error, cancellation) aborts the load
"""

from kvflow.config import EngineConfig, parse_size, spare_cpus
from kvflow.devices import CpuDevice, CudaDevice, DeviceOps, StreamDevice, device_ops
from kvflow.errors import (
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    KVFlowError,
    LayoutError,
    MissingDependencyError,
    PoolRefusedError,
    PoolRunningError,
    ProtocolError,
    StoreError,
    StoreUnavailableError,
    TransferTimeoutError,
)
from kvflow.keys import ChunkHashes, KeySpace, chunk_hashes
from kvflow.layout import SKIP_BLOCK, KVLayout, KVPart
from kvflow.pipeline import (
    LoadHandle,
    SaveHandle,
    SyncLoadHandle,
    SyncSaveHandle,
    SyncTransferEngine,
    TransferEngine,
)
from kvflow.pipeline.engine import Request
from kvflow.pool.store import SharedStore
from kvflow.pool.store_config import SharedStoreConfig
from kvflow.results import ChunkStatus, RequestResult, TransferResult
from kvflow.stats import EngineStats
from kvflow.stores import (
    CopyRecord,
    Direction,
    InstrumentedStore,
    LocalStore,
    MemcacheConfig,
    MemcacheStats,
    MemcacheStore,
    MooncakeConfig,
    MooncakeMaster,
    MooncakeStats,
    MooncakeStore,
    ReadSession,
    Store,
    StoreUsage,
    SupportsPrefixContext,
    SupportsUsage,
    WriteSession,
    WriteStatus,
)

__version__ = "0.1.0"

__all__ = [
    "ChunkStatus",
    "ClosedError",
    "ConfigError",
    "CpuDevice",
    "CudaDevice",
    "CopyRecord",
    "DeviceOps",
    "Direction",
    "EngineConfig",
    "EngineStats",
    "InstrumentedStore",
    "InvalidArgumentError",
    "KVFlowError",
    "KVLayout",
    "KVPart",
    "ChunkHashes",
    "KeySpace",
    "LayoutError",
    "LoadHandle",
    "LocalStore",
    "MemcacheConfig",
    "MemcacheStats",
    "MemcacheStore",
    "MissingDependencyError",
    "MooncakeConfig",
    "MooncakeMaster",
    "MooncakeStats",
    "MooncakeStore",
    "PoolRefusedError",
    "PoolRunningError",
    "ProtocolError",
    "ReadSession",
    "SKIP_BLOCK",
    "Request",
    "RequestResult",
    "SaveHandle",
    "SharedStore",
    "SharedStoreConfig",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "StoreUsage",
    "StreamDevice",
    "SupportsPrefixContext",
    "SupportsUsage",
    "SyncLoadHandle",
    "SyncSaveHandle",
    "SyncTransferEngine",
    "TransferEngine",
    "TransferResult",
    "TransferTimeoutError",
    "WriteSession",
    "WriteStatus",
    "__version__",
    "chunk_hashes",
    "device_ops",
    "parse_size",
    "spare_cpus",
]
