"""KVFlowConnector: kvflow as a vLLM KV connector (``KVConnectorBase_V1``).

vLLM builds the connector twice: in the engine-core process as the SCHEDULER, which decides hits
from one batched pool lookup of the request's own block hashes and plans each step's loads and
saves (``planner.ChunkPlanner``), and in each worker as the WORKER, which moves the bytes through
a SyncTransferEngine, layer by layer. They share no memory: the plan travels in
``KVFlowConnectorMetadata``. This class only forwards each of vLLM's calls to its role's side:

* ``scheduler.KVFlowConnectorScheduler``: the lookups and the step plans;
* ``worker.KVFlowConnectorWorker``: the transfers;
* ``metadata.KVFlowConnectorMetadata``: the plan, from one to the other;
* ``pools``: the pool each side opens (the store ``kv_connector_extra_config`` names);
* ``metrics``: the counters both sides keep, for vLLM's log and Prometheus ``/metrics``.

Scheduler, per step: ``get_num_new_matched_tokens(request)`` for each request it considers
(the hit, in tokens beyond vLLM's own prefix-cache hit; asked again for a request it could not
schedule), ``update_state_after_alloc`` once the request's blocks are allocated, then
``build_connector_meta``: the step's plan. ``request_finished`` when a request ends: vLLM may
free its blocks at once (with several KV cache groups, vLLM's hybrid manager,
``request_finished_all_groups``), and the next plan names it among the requests whose blocks
were freed, so that a save still reading them ends before that step's forward. With a
sliding window or several groups the hit's load is asynchronous (``get_num_new_matched_tokens``
says so): vLLM runs the request once a worker reports the load in (``get_transfer_results``),
and ``update_connector_output`` brings the scheduler the loads that failed, which vLLM computes
from the first token.

Worker: ``register_kv_caches`` once, at start (the layout; the pool opens). Per step, the
metadata is bound before the forward. The step's load and save start at the first of
``start_load_kv`` and the first per-layer hook (vLLM may call the hooks first); neither waits
for the pool's session, which opens while the first layers compute;
``wait_for_layer_load(layer)`` blocks until that layer is in place (or, with
``use_layerwise: false``, the whole load waits before layer 0). ``save_kv_layer(layer)`` hands a
layer of the step's newly completed chunks to the save as soon as attention wrote it.
``wait_for_save`` waits for the step's load to end and for the save (every wait bounded), or,
with ``save_across_steps``, leaves the save's last copies and commit to run on beside the next
step: the next step ends it before its forward if vLLM freed a block it reads, else at its own
end (``worker``). Chunks that failed to load are reported by
``get_block_ids_with_load_errors`` (asked before ``wait_for_save``, when vLLM defers it, it
ends the step itself), and vLLM recomputes them (with ``kv_load_failure_policy:
"recompute"``) or fails the request (its default, ``"fail"``). ``clear_connector_metadata``
ends a step vLLM did not end with ``wait_for_save``.

Both sides: ``get_kv_connector_stats`` every step (the counters since the last call);
``shutdown`` at the end. vLLM's front end calls the class methods ``build_kv_connector_stats``
and ``build_prom_metrics``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvflow import trace
from kvflow.integrations.vllm.caches import CacheGroup
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.group_workers import GroupWorkers
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
from kvflow.integrations.vllm.metrics import KVFlowConnectorStats, KVFlowPromMetrics
from kvflow.integrations.vllm.scheduler import KVFlowConnectorScheduler
from kvflow.integrations.vllm.support import blocks_written_in_forward_only, check_supported
from kvflow.integrations.vllm.worker import KVFlowConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVFlowConnector", "KVFlowConnectorMetadata", "KVFlowConnectorStats"]

log = logging.getLogger("kvflow")


def _log_like_vllm() -> None:
    """kvflow's log lines go where vLLM's go (its handlers), at INFO."""
    ours, theirs = logging.getLogger("kvflow"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class KVFlowConnector(KVConnectorBase_V1, SupportsHMA):
    """kvflow's layerwise KV pool for vLLM. ``kv_transfer_config={"kv_connector":
    "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm", "kv_role":
    "kv_both", "kv_connector_extra_config": {...}}``; see ``ConnectorConfig`` for the keys.
    ``kv_role`` ``kv_producer`` (a prefill node) looks up, loads and saves as ``kv_both`` does;
    ``kv_consumer`` (a decode node) looks up and loads, and saves only with
    ``save_decode_cache`` (``ConnectorConfig.saves_as``); any other role is refused at start.

    Concurrency: vLLM calls each side from one thread (the scheduler's loop; the worker's model
    thread). Worker hooks block at most ``op_timeout_s`` each (a stuck load costs one timeout
    per step, not one per layer); copies run on the engine's own threads. The scheduler's
    lookup blocks at most ``lookup_timeout_s``, and not at all while an earlier one hangs.
    With vLLM's hybrid KV cache manager (``SupportsHMA``), each KV cache group is planned and
    moved on its own (``groups``, ``group_workers``). Refused at start: what
    ``support.check_supported`` lists (attention kinds whose kept blocks it does not know,
    pipeline or decode-context parallelism, speculative decoding whose drafter has attention
    layers)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        trace.set_role(role.name.lower())
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.config = ConnectorConfig.from_extra_config(extra)
        kv_role = vllm_config.kv_transfer_config.kv_role
        self.config.saves_as(kv_role)  # refuses a role it does not know, at start
        assert kv_cache_config is not None, "this vLLM passes no kv_cache_config"
        check_supported(vllm_config, kv_cache_config)
        groups = [
            CacheGroup.from_vllm(vllm_config, kv_cache_config, self.config, g)
            for g in range(len(kv_cache_config.kv_cache_groups))
        ]
        if len(groups) > 1:
            log.info(
                "kvflow: %d KV cache groups (vLLM's hybrid KV cache manager): %s",
                len(groups),
                ", ".join(f"{type(g.spec).__name__} x{g.num_layers}" for g in groups),
            )
        self.connector_scheduler: KVFlowConnectorScheduler | None = None
        self.connector_worker: KVFlowConnectorWorker | GroupWorkers | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVFlowConnectorScheduler(
                self.config,
                groups,
                kv_role,
                forward_only_writes=blocks_written_in_forward_only(vllm_config, kv_cache_config),
            )
        elif len(groups) == 1:
            self.connector_worker = KVFlowConnectorWorker(self.config, groups[0], vllm_config)
        else:
            self.connector_worker = GroupWorkers(self.config, groups, vllm_config)

    @property
    def _scheduler(self) -> KVFlowConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler call to a worker's connector"
        return self.connector_scheduler

    @property
    def _worker(self) -> KVFlowConnectorWorker | GroupWorkers:
        assert self.connector_worker is not None, "a worker call to the scheduler's connector"
        return self.connector_worker

    # -- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVFlowConnectorMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished, failed = self._worker.finished_async_loads()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker.clear()

    # -- both sides ---------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.connector_scheduler or self.connector_worker
        return side.take_stats() if side is not None else None

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if trace.ENABLED:
            trace.flush()  # vLLM may end this process without running its exit handlers

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVFlowConnectorStats(data=dict(data)) if data is not None else KVFlowConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVFlowPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
