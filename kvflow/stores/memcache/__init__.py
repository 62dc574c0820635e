"""Ascend memcache (MemFabric Hybrid), a pool at global addresses: ``MemcacheStore``
(store.py), its config, and its client's calls and codes (client.py).

Importing this imports no part of memcache: ``memcache_hybrid`` is imported when a MemcacheStore
makes its client (``client.memcache_module``).
"""

from kvflow.stores.memcache.config import MemcacheConfig
from kvflow.stores.memcache.store import MemcacheStats, MemcacheStore

__all__ = ["MemcacheConfig", "MemcacheStats", "MemcacheStore"]
