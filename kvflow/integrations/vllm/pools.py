"""Which pool the connector uses: the store ``kv_connector_extra_config`` names, opened once per
role when vLLM builds the connector (the scheduler) or hands it its KV caches (each worker).

``shared`` (the default): a client of the node-local pool server, which it may start; the
scheduler's client never copies, so it maps no page-locked memory. ``mooncake``: a Mooncake
Store client; the scheduler's is a pure client (no segment), a worker's is created on its copy
CPUs so that its transfer threads run there. ``memcache``: Ascend memcache, for the worker's
device. ``local``: one embedded pool per process, which the scheduler and the worker of a
single-process vLLM (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) share through a process-wide
registry; closing it is a no-op.

A pool that cannot be reached is logged and replaced by none: every lookup then misses and
nothing is saved, and vLLM runs as without the connector.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from kvflow.errors import KVFlowError
from kvflow.pipeline.executor import call_pinned
from kvflow.stores.base import Store
from kvflow.stores.wrapper import StoreWrapper

if TYPE_CHECKING:
    from kvflow.integrations.vllm.config import ConnectorConfig

__all__ = ["make_store", "open_pool"]

log = logging.getLogger("kvflow")
# a backstop for creating a worker's pool client on the copy CPUs: each native call inside is
# bounded by the store's own timeout_s already
_STORE_OPEN_TIMEOUT_S = 120.0


def open_pool(
    config: ConnectorConfig,
    *,
    scheduler: bool,
    device: str = "cpu",
    copy_cpus: tuple[int, ...] = (),
) -> Store | None:
    """The configured pool (for KV caches on ``device``), or None (logged) when it cannot be
    reached. ``copy_cpus``: a worker's, where a Mooncake client is created (the shared pool's
    server, which a store may start, is not pinned to one worker's CPUs)."""
    kind = config.store
    role = "scheduler" if scheduler else "worker"
    cpus = copy_cpus if kind == "mooncake" and not scheduler else ()
    try:
        store = call_pinned(
            cpus,
            make_store,
            config,
            scheduler,
            device,
            timeout_s=_STORE_OPEN_TIMEOUT_S,
            on_late=Store.close,
        )
    except KVFlowError as exc:
        log.error("kvflow: the %s pool is unavailable (%s); running without it", kind, exc)
        return None
    log.info("kvflow: %s connector on the %s pool: %r", role, kind, store)
    return store


def make_store(config: ConnectorConfig, scheduler: bool, device: str = "cpu") -> Store:
    """The pool the config names. The scheduler only looks up: a Mooncake scheduler is a pure
    client. ``local`` gives one embedded pool per process (scheduler and worker must share it)."""
    if config.store == "shared":
        from kvflow.pool.store import SharedStore

        shared = config.shared_config()
        if scheduler:  # it never copies: no CUDA context, no page-locked mapping
            shared = replace(shared, pin=False)
        return SharedStore(shared)
    if config.store == "mooncake":
        from kvflow.stores.mooncake import MooncakeStore

        return MooncakeStore(config.mooncake_config(pure_client=scheduler))
    if config.store == "memcache":
        from kvflow.stores.memcache import MemcacheStore

        return MemcacheStore(config.memcache_config(device))
    return _local_store(int(config.local_capacity))


_LOCAL: dict[int, Store] = {}  # per process id: a forked child builds its own
_LOCAL_LOCK = threading.Lock()


def _local_store(capacity: int) -> Store:
    from kvflow.stores.local import LocalStore

    with _LOCAL_LOCK:
        store = _LOCAL.get(os.getpid())
        if store is None:
            store = _LOCAL[os.getpid()] = _SharedLocal(LocalStore(capacity))
        return store


class _SharedLocal(StoreWrapper):
    """One process's embedded pool, shared by its scheduler and worker connectors; closing it
    is a no-op (it lives as long as the process)."""

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"process-wide {self.inner!r}"
