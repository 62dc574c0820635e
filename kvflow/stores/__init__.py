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

__all__ = [
    "CopyRecord",
    "Direction",
    "InstrumentedStore",
    "LocalStore",
    "ReadSession",
    "Store",
    "StoreUsage",
    "SupportsUsage",
    "WriteSession",
    "WriteStatus",
]
