"""The node-local shared pool: a server process (``kvflow serve``) that owns a shared-memory
arena and its index, and the wire protocol its clients (``kvflow.SharedStore``) speak."""

from kvflow.pool.server import PoolConfig, PoolServer

__all__ = ["PoolConfig", "PoolServer"]
