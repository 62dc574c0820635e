"""Every store the contract suite and the engine tests run against, by name.

To run the suites against another pool engine, add one entry to STORE_FACTORIES: a name and a
callable that takes a capacity in bytes and returns an open store of exactly that capacity (the
eviction tests count objects). A factory whose engine is unavailable may call ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvflow
from kvflow.abc import Store
from kvflow.config import parse_size
from kvflow.pool import PoolConfig, PoolServer
from kvflow.stores.mooncake.master import MooncakeMaster, find_master_binary
from tests.support.memcache_standin import MemcacheStandIn

__all__ = [
    "ARENA_STORE_NAMES",
    "STORE_FACTORIES",
    "STORE_NAMES",
    "ServedSharedStore",
    "close_stores",
    "dispose",
    "long_lived_store",
    "make_store",
    "memcache_standin_store",
    "release_store",
    "require_mooncake",
    "MooncakeMaster",
    "mooncake_master",
    "mooncake_store",
    "open_sessions",
    "reported_usage",
    "stop_master",
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
        options.setdefault("timeout_s", 60.0)  # each request's bound: far above a stall
        super().__init__(socket=socket, **options)

    def stop_server(self) -> None:
        self.server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


_SERVED: list[ServedSharedStore] = []


def dispose(store: Store) -> None:
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


_MASTER: MooncakeMaster | None = None


def mooncake_master() -> MooncakeMaster:
    """The test session's master, started on first use (``stop_master`` ends it)."""
    global _MASTER
    require_mooncake()
    if _MASTER is None or not _MASTER.running:
        _MASTER = MooncakeMaster()
    return _MASTER


_LONG_LIVED: dict[str, Store] = {}


def long_lived_store(name: str, capacity: int | str) -> Store:
    """A store for many short runs in one test (hypothesis examples): a fresh one for the
    in-process pools; for Mooncake one client kept for the test session (a client takes
    seconds to close), so every run must use keys of its own (a model name of its own)."""
    if name != "mooncake":
        return make_store(name, capacity)
    store = _LONG_LIVED.get(name)
    if store is None:
        store = _LONG_LIVED[name] = mooncake_store(256 << 20)
    return store


def release_store(name: str, store: Store) -> None:
    """The end of one run on a ``long_lived_store``."""
    if name != "mooncake":
        dispose(store)


def stop_master() -> None:
    global _MASTER
    close_stores()
    while _LONG_LIVED:
        _LONG_LIVED.popitem()[1].close()
    if _MASTER is not None:
        _MASTER.stop()
        _MASTER = None


def mooncake_store(
    capacity: int, master: str | None = None, **options: Any
) -> kvflow.MooncakeStore:
    """A MooncakeStore on the session's master whose own segment holds ``capacity`` bytes."""
    segment = max(capacity, 16 << 20)
    options.setdefault("key_prefix", f"t{next(_PREFIXES)}/")  # every store its own keys
    return kvflow.MooncakeStore(
        master_server_address=master or mooncake_master().address,
        local_hostname="127.0.0.1",
        global_segment_size=segment,
        timeout_s=5.0,
        **options,
    )


_PREFIXES = itertools.count(os.getpid() << 20)


def memcache_standin_store(
    capacity: int, *, client: MemcacheStandIn | None = None, **options: Any
) -> kvflow.MemcacheStore:
    """A MemcacheStore over MemcacheStandIn (``tests/support/memcache_standin.py``, memcache's
    calls in memory: no Ascend hardware here) whose pool is an arena of ``capacity`` bytes."""
    options.setdefault("timeout_s", 60.0)  # each call's bound: far above a stall of the machine
    config = kvflow.MemcacheConfig(
        meta_service_url="tcp://127.0.0.1:5000", config_store_url="tcp://127.0.0.1:6000", **options
    )
    return kvflow.MemcacheStore(config, client=client or MemcacheStandIn(capacity))


def require_mooncake() -> None:
    """Skip (fail, in CI) unless Mooncake's client imports and its master is installed."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        unavailable(f"Mooncake does not import ({exc}); pip install 'kvflow[mooncake]'")
    if find_master_binary() is None:
        unavailable("mooncake_master is not installed (pip install 'kvflow[mooncake]')")


def unavailable(reason: str) -> None:
    """In CI a missing engine fails the test; elsewhere it skips it."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


StoreFactory = Callable[[int], Store]

STORE_FACTORIES: dict[str, StoreFactory] = {
    "local": lambda capacity: kvflow.LocalStore(capacity),
    "shared": lambda capacity: ServedSharedStore(capacity),
    "mooncake": lambda capacity: mooncake_store(capacity),
    "memcache_standin": lambda capacity: memcache_standin_store(capacity),
}
STORE_NAMES = sorted(STORE_FACTORIES)
# pools with a fixed-size arena, LRU eviction and usage(): tests that fill the pool to watch
# eviction run on these (Mooncake's segments start at 16 MiB and it evicts by watermark;
# memcache evicts by its own policy and its occupancy is the meta service's, so MemcacheStore
# reports no usage())
ARENA_STORE_NAMES = [name for name in STORE_NAMES if name not in ("mooncake", "memcache_standin")]


SESSION_FIELDS = ("pending_writes", "leases", "open_sessions")


def reported_usage(store: Store) -> dict[str, int]:
    """The StoreUsage fields a store reports: all of them where it supports usage(), else the
    session counts of its own ``stats()`` (MooncakeStore: occupancy is the master's)."""
    inner = getattr(store, "inner", store)
    u = inner.usage()
    if u is not None:
        return dataclasses.asdict(u)
    stats = getattr(inner, "stats", None)
    assert stats is not None, f"{type(inner).__name__} reports neither usage() nor stats()"
    counts = stats()
    return {name: int(getattr(counts, name)) for name in SESSION_FIELDS}


def open_sessions(store: Store) -> int:
    """Sessions the store holds open, however it reports them."""
    return reported_usage(store)["open_sessions"]


def make_store(name: str, capacity: int | str) -> Store:
    """A fresh store from the registry; the caller closes it (``close_stores`` closes what a
    test left open)."""
    store = STORE_FACTORIES[name](parse_size(capacity))
    _MADE.append(store)
    return store


_MADE: list[Store] = []


def close_stores() -> None:
    """Close every store ``make_store`` made (closing twice is allowed): a Mooncake client left
    open keeps its segment on the master, and once the master is gone its teardown at
    interpreter exit retries the master for minutes."""
    while _MADE:
        _MADE.pop().close()


@contextlib.contextmanager
def pool_server(socket: str, capacity: str) -> Iterator[PoolServer]:
    """A kvflow pool server on ``socket`` with ``capacity``, on threads of this process, stopped
    however the block ends."""
    server = PoolServer(PoolConfig(socket=socket, capacity=capacity))
    server.start()
    try:
        yield server
    finally:
        server.stop()
