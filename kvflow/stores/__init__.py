"""Pool engines behind one interface (``Store``); see ``kvflow.stores.base`` for the contract."""

from kvflow.stores.base import (
    Direction,
    ReadSession,
    Store,
    StoreUsage,
    WriteSession,
    WriteStatus,
    deprecated_name,
)
from kvflow.stores.local import LocalStore
from kvflow.stores.memcache import MemcacheConfig, MemcacheStats, MemcacheStore
from kvflow.stores.mooncake import MooncakeConfig, MooncakeMaster, MooncakeStats, MooncakeStore
from kvflow.stores.wrapper import StoreWrapper

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
    "StoreWrapper",
    "WriteSession",
    "WriteStatus",
]


def __getattr__(name: str) -> type:
    return deprecated_name(__name__, name)
