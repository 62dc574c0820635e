"""The node-local shared pool: a server process (``kvflow serve``) that owns a shared-memory
arena and its index, the wire protocol, and the store that is its client (``kvflow.SharedStore``,
``store.py``)."""

from kvflow.pool.config import PoolConfig
from kvflow.pool.server import PoolServer

__all__ = ["PoolConfig", "PoolServer"]
