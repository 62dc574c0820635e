"""Every store the contract suite and the engine tests run against, by name.

To run the suites against another pool engine, add one entry to STORE_FACTORIES: a name and a
callable that takes a capacity in bytes and returns an open store of exactly that capacity (the
eviction tests count objects). A factory whose engine is unavailable may call ``pytest.skip``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import kvflow
from kvflow.pool import PoolConfig, PoolServer

__all__ = [
    "STORE_FACTORIES",
    "STORE_NAMES",
    "ServedSharedStore",
    "dispose",
    "make_store",
    "stop_servers",
]


class ServedSharedStore(kvflow.SharedStore):
    """A SharedStore with a pool server of its own: the real server, on a real Unix socket in a
    fresh private directory, run on threads of this process. ``close()`` closes the client
    only (the pool outlives its clients: tests check its state afterwards); ``dispose()`` or
    the end of the test stops the server."""

    def __init__(self, capacity: int, *, lease_ttl_s: float = 300.0, **options: Any) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvflow-")
        socket = f"{self.directory}/pool.sock"
        config = PoolConfig(socket=socket, capacity=capacity, lease_ttl_s=lease_ttl_s)
        self.server = PoolServer(config)
        self.server.start()
        _SERVED.append(self)
        super().__init__(socket=socket, **options)

    def stop_server(self) -> None:
        self.server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


_SERVED: list[ServedSharedStore] = []


def dispose(store: kvflow.Store) -> None:
    """Close ``store`` and stop the server behind it, if the test started one."""
    store.close()
    if isinstance(store, ServedSharedStore):
        store.stop_server()
        _SERVED.remove(store)


def stop_servers() -> None:
    """Stop every server a test started and left running."""
    while _SERVED:
        served = _SERVED.pop()
        served.close()
        served.stop_server()


StoreFactory = Callable[[int], kvflow.Store]

STORE_FACTORIES: dict[str, StoreFactory] = {
    "local": lambda capacity: kvflow.LocalStore(capacity),
    "shared": lambda capacity: ServedSharedStore(capacity),
}
STORE_NAMES = sorted(STORE_FACTORIES)


def make_store(name: str, capacity: int | str) -> kvflow.Store:
    """A fresh store from the registry; the caller closes it."""
    return STORE_FACTORIES[name](kvflow.parse_size(capacity))
