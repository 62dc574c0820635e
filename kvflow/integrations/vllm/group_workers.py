"""Several KV cache groups (vLLM's hybrid KV cache manager), on the worker side.

vLLM hands the worker every group's layers in one dict. ``GroupWorkers`` gives each group a
``worker.KVFlowConnectorWorker`` of its own: the group's layers as its layout, its transfer
engine and its keys (``caches.CacheGroup`` names the group in them), on one pool the first of
them opens. A step's plan is split by ``Transfer.group``; each per-layer hook goes to the
worker of the layer's group. Loads are all asynchronous for vLLM with several groups
(``groups``): a request's load has ended once every group's has, and failed when any group's
failed (vLLM then computes the request from its first token). The counters are summed over
the groups (a token loaded into two groups' layers counts twice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
from kvflow.integrations.vllm.pools import open_pool
from kvflow.integrations.vllm.worker import KVFlowConnectorWorker

if TYPE_CHECKING:
    import torch

    from kvflow.integrations.vllm.caches import CacheGroup
    from kvflow.integrations.vllm.config import ConnectorConfig
    from kvflow.integrations.vllm.metrics import KVFlowConnectorStats
    from kvflow.stores.base import Store

__all__ = ["GroupWorkers"]


class GroupWorkers:
    """One ``KVFlowConnectorWorker`` per KV cache group, behind the one worker's calls. Not
    thread-safe: vLLM calls it from the model thread, in the worker connector's order."""

    def __init__(
        self, config: ConnectorConfig, groups: Sequence[CacheGroup], vllm_config: Any
    ) -> None:
        self.config = config
        self.workers = [KVFlowConnectorWorker(config, group, vllm_config) for group in groups]
        self._group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self._store: Store | None = None
        self._opened = False
        self._pending: dict[str, set[int]] = {}  # asynchronous loads: the groups still loading
        self._failed: set[str] = set()  # of those, the requests a group's load failed

    def _open_store(self, **kwargs: Any) -> Store | None:
        """The pool every group's worker moves through, opened once."""
        if not self._opened:
            self._opened = True
            self._store = open_pool(self.config, scheduler=False, **kwargs)
        return self._store

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for g, worker in enumerate(self.workers):
            mine = {name: t for name, t in kv_caches.items() if self._group_of.get(name) == g}
            worker.register_kv_caches(mine, open_store=self._open_store)

    def bind(self, meta: KVFlowConnectorMetadata) -> None:
        for g, worker in enumerate(self.workers):
            worker.bind(
                dataclasses.replace(  # the same save_waits and released in every group
                    meta,
                    loads=[t for t in meta.loads if t.group == g],
                    saves=[t for t in meta.saves if t.group == g],
                    async_loads=[t for t in meta.async_loads if t.group == g],
                )
            )
        for t in meta.async_loads:
            self._pending.setdefault(t.req_id, set()).add(t.group)

    def _worker(self, layer_name: str) -> KVFlowConnectorWorker | None:
        g = self._group_of.get(layer_name)
        return None if g is None else self.workers[g]

    def start_load_kv(self) -> None:
        for worker in self.workers:
            worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self._worker(layer_name)
        if worker is not None:
            worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        worker = self._worker(layer_name)
        if worker is not None:
            worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        for worker in self.workers:
            worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(w.get_block_ids_with_load_errors() for w in self.workers))

    def finished_async_loads(self) -> tuple[set[str], set[str]]:
        """The requests whose load ended in every group since the last call, and of those the
        ones whose load failed in any group."""
        for g, worker in enumerate(self.workers):
            finished, failed = worker.finished_async_loads()
            self._failed |= failed
            for req_id in finished:
                self._pending.get(req_id, set()).discard(g)
        done = {req_id for req_id, groups in self._pending.items() if not groups}
        for req_id in done:
            del self._pending[req_id]
        failed, self._failed = self._failed & done, self._failed - done
        return done, failed

    def clear(self) -> None:
        for worker in self.workers:
            worker.clear()

    def take_stats(self) -> KVFlowConnectorStats | None:
        out = None
        for worker in self.workers:
            stats = worker.take_stats()
            if stats is not None:
                out = stats if out is None else out.aggregate(stats)
        return out

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self._store is not None:
            self._store.close()
            self._store = None
