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
from kvflow.stores.local import LocalStore
from kvflow.stores.memcache import MemcacheConfig, MemcacheStats, MemcacheStore
from kvflow.stores.mooncake import MooncakeConfig, MooncakeMaster, MooncakeStats, MooncakeStore

__all__ = [
    "Direction",
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
