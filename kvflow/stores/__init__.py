"""Pool engines behind one interface (``Store``); see ``kvflow.stores.base`` for the contract."""

from kvflow.stores.base import (
    Direction,
    ReadSession,
    Store,
    StoreUsage,
    SupportsPrefixContext,
    SupportsUsage,
    WriteSession,
    WriteStatus,
)
from kvflow.stores.instrumented import CopyRecord, InstrumentedStore
from kvflow.stores.local import LocalStore
from kvflow.stores.memcache import MemcacheStats, MemcacheStore
from kvflow.stores.memcache_config import MemcacheConfig
from kvflow.stores.mooncake import MooncakeStats, MooncakeStore
from kvflow.stores.mooncake_config import MooncakeConfig
from kvflow.stores.mooncake_master import MooncakeMaster

__all__ = [
    "CopyRecord",
    "Direction",
    "InstrumentedStore",
    "LocalStore",
    "MemcacheConfig",
    "MemcacheStats",
    "MemcacheStore",
    "MooncakeConfig",
    "MooncakeMaster",
    "MooncakeStats",
    "MooncakeStore",
    "ReadSession",
    "Store",
    "StoreUsage",
    "SupportsPrefixContext",
    "SupportsUsage",
    "WriteSession",
    "WriteStatus",
]
