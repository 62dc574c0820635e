"""Pool engines behind one interface (``Store``); see ``kvflow.stores.base`` for the contract."""

from kvflow.stores.base import (
    Direction,
    ReadSession,
    Store,
    StoreUsage,
    SupportsUsage,
    WriteSession,
    WriteStatus,
)
from kvflow.stores.instrumented import CopyRecord, InstrumentedStore
from kvflow.stores.local import LocalStore
from kvflow.stores.shared import SharedStore, SharedStoreConfig

__all__ = [
    "CopyRecord",
    "Direction",
    "InstrumentedStore",
    "LocalStore",
    "ReadSession",
    "SharedStore",
    "SharedStoreConfig",
    "Store",
    "StoreUsage",
    "SupportsUsage",
    "WriteSession",
    "WriteStatus",
]
