"""KVFlowConnectorWorker: the connector's worker side, in each of vLLM's worker processes.

It moves the bytes the scheduler's plan names (``KVFlowConnectorMetadata``) between vLLM's KV
cache blocks and the pool, through a ``SyncTransferEngine``, layer by layer: a step's load and
save start at its first hook (``start_load_kv`` or the first per-layer one: vLLM may call the
hooks first), and neither waits for the pool's session, which opens while the first layers
compute. ``wait_for_layer_load(layer)`` blocks until that layer is in place (with
``use_layerwise: false`` the whole load waits before layer 0); ``save_kv_layer(layer)`` hands
each layer of the step's completed chunks to the save as soon as attention wrote it;
``wait_for_save`` ends the step, after which vLLM may reuse its blocks: it waits for the load,
and for the save unless the plan lets the save run on beside the next step (``save_waits``
false: ``ConnectorConfig.save_across_steps``). Such a save reads only blocks of requests vLLM
still runs; the next step ends it at ``bind``, before its forward, if the plan says vLLM freed
one of them (``released``), else at its own ``wait_for_save``. Chunks that failed to load are
reported by ``get_block_ids_with_load_errors``.

Asynchronous loads (a sliding window's hits: the plan's ``async_loads``, one per request) start
with the step's transfers and run on, across steps, for requests vLLM runs only once they are
in; ``finished_async_loads`` reports, at each step's end, those that ended and those that
failed (vLLM then computes the request from its first token).

A step that loads and saves stores nothing when its load failed on any tensor-parallel rank
(its KV may rest on a bad prefix): its save holds the last layer until every rank's load is
known good, so it cannot commit first.

Concurrency: vLLM calls it from the model thread; copies run on the engine's threads. Every
wait is bounded by ``op_timeout_s``, and after one failed layer wait the step waits for no
other layer (a stuck load costs one timeout per step, not one per layer). A copy still running
past the engine's grace after its transfer was dropped stops the worker's transfers for good:
vLLM may reuse the blocks it would touch.

The parts: ``steps`` (one step's state), ``async_loads`` (the loads that outlive a step),
``transfers`` (the engine, results, drops, counts) and ``failures`` (a forward cut short, a
load failed on another rank).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvflow import trace
from kvflow.cpus import affinity
from kvflow.errors import KVFlowError
from kvflow.integrations.vllm.async_loads import AsyncLoads
from kvflow.integrations.vllm.caches import group_layout
from kvflow.integrations.vllm.config import AUTO
from kvflow.integrations.vllm.failures import failed_on_any_rank, forward_cut, stop_cut_step
from kvflow.integrations.vllm.metrics import KVFlowConnectorStats, StatsInterval
from kvflow.integrations.vllm.pools import open_pool
from kvflow.integrations.vllm.steps import Step, start_transfer
from kvflow.integrations.vllm.transfers import Transfers
from kvflow.pipeline.sync import SyncTransferEngine

if TYPE_CHECKING:
    from kvflow.integrations.vllm.caches import CacheGroup
    from kvflow.integrations.vllm.config import ConnectorConfig
    from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
    from kvflow.stores.base import Store

__all__ = ["KVFlowConnectorWorker"]

log = logging.getLogger("kvflow")


class KVFlowConnectorWorker:
    """The worker side of ``KVFlowConnector``: one worker's loads and saves, step by step."""

    def __init__(self, config: ConnectorConfig, group: CacheGroup, vllm_config: Any) -> None:
        self.config = config
        self.group = group
        self.vllm_config = vllm_config
        self._store: Store | None = None
        self._copy_cpus: tuple[int, ...] = ()  # set with the KV caches
        self._layer_index: dict[str, int] = {}
        self._step: Step | None = None
        self._load_errors: set[int] = set()
        self._rank = 0
        self._saves_here = True
        self._last_layer = -1
        self._stats = StatsInterval()
        self._transfers = Transfers(config, group, self._stats)
        self._async = AsyncLoads(self._transfers)
        self._owns_store = True

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        open_store: Callable[..., Store | None] | None = None,
    ) -> None:
        """The group's layers' tensors. ``open_store(device=, copy_cpus=)``: the pool, when
        another owns it (several groups share one); else the worker opens and closes its own."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
        self._rank = 0 if self.group.mla else tp_rank
        self._saves_here = not (self.group.mla and tp_rank != 0)
        self._transfers.debug_here = self.config.debug_rank in (None, tp_rank)
        names, layout = group_layout(self.group, kv_caches, self.vllm_config)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._last_layer = len(names) - 1
        self._transfers.block_bytes = sum(
            layout.layer_block_bytes(i) for i in range(layout.num_layers)
        )
        self._copy_cpus = self.config.copy_cpus_here(layout.device)  # vLLM has bound its threads
        model_cpus = affinity()
        log.info(
            "kvflow: worker copy threads on CPUs %s, the model thread on %s",
            list(self._copy_cpus) or "(not pinned)",
            model_cpus,
        )
        if self.config.copy_cpus == AUTO and self._copy_cpus and self.group.tp_size > 1:
            log.warning(
                'kvflow: copy_cpus "auto" with %d workers: the CPUs %s may be another '
                "worker's compute cores; list the reserved cores in copy_cpus",
                self.group.tp_size,
                list(self._copy_cpus),
            )
        self._owns_store = open_store is None
        opener = open_store or functools.partial(open_pool, self.config, scheduler=False)
        self._store = opener(device=layout.device, copy_cpus=self._copy_cpus)
        if self._store is None:
            return
        engine_config = self.config.engine_config(
            block_size=self.group.block_size,
            model=self.group.model,
            rank=self._rank,
            copy_cpus=self._copy_cpus,
        )
        self._transfers.engine = SyncTransferEngine(
            layout, self._store, engine_config, keyspace=self.group.keyspace(self._rank)
        )

    def bind(self, meta: KVFlowConnectorMetadata) -> None:
        """The step's plan, before its forward. A save the step before left running ends
        now if it reads a block vLLM freed since (``meta.released``: the forward may write
        it) or the step loads (its copies would queue behind the save's)."""
        self._transfers.before_forward(meta.released, bool(meta.loads or meta.async_loads))
        self._step = Step(meta)

    def start_load_kv(self) -> None:
        begun = trace.now() if trace.ENABLED else 0
        self._start_load()
        if begun:
            trace.complete("start_load_kv", begun, "step")

    def _start_load(self) -> Step | None:
        """Start the step's transfers, once, at its first hook: the load, then the save (whose
        store session then opens while the first layers compute)."""
        step = self._step
        if step is None or step.load_started:
            return step
        step.load_started = True
        self._begin_load(step)
        self._begin_save(step)
        self._async.start(step.meta.async_loads)
        return step

    def _begin_load(self, step: Step) -> None:
        if not step.meta.loads:
            return
        engine = self._transfers.engine
        if engine is None:  # the scheduler planned loads this worker cannot make
            step.load_failed = True
            return
        step.load = start_transfer(step, "load", step.meta.loads, engine.start_load)
        if step.load is None:
            step.load_failed = True
            return
        if not self.config.use_layerwise:  # everything before the forward
            for layer in range(self.group.num_layers):
                self._wait_layer(step, layer)

    def finished_async_loads(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous load ended since the last call, and of those the
        ones whose load failed (see ``AsyncLoads.finished``)."""
        return self._async.finished()

    def _begin_save(self, step: Step) -> None:
        engine = self._transfers.engine
        if engine is None or not step.meta.saves or not self._saves_here:
            return
        if self.config.debug_skip_saves and self._transfers.debug_here:
            return
        step.save = start_transfer(step, "save", step.meta.saves, engine.start_save)
        step.save_stopped = step.save is None  # a save that cannot start is dropped: a future miss

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._start_load()
        layer = self._layer_index.get(layer_name)
        if step is not None and layer is not None:
            step.hooked_layer = max(step.hooked_layer, layer)
        if step is None or step.load is None or layer is None or not self.config.use_layerwise:
            return
        self._wait_layer(step, layer)

    def _wait_layer(self, step: Step, layer: int) -> None:
        """Wait for one layer; after a failed wait, none: every block of the step's load is
        reported failed anyway, and a stuck copy must not cost every later layer its timeout."""
        if step.load is None or step.load_failed:
            return
        start = time.perf_counter()
        try:
            step.load.wait_layer(layer, timeout=self.config.op_timeout_s)
        except KVFlowError as exc:
            log.warning("kvflow: waiting for layer %d's load: %s", layer, exc)
            step.load_failed = True
        waited = time.perf_counter() - start
        with self._stats.update() as stats:
            stats.record_layer_wait(waited)

    def save_kv_layer(self, layer_name: str) -> None:
        step = self._start_load()
        layer = self._layer_index.get(layer_name)
        if step is not None and layer is not None:
            step.hooked_layer = max(step.hooked_layer, layer)
        if step is None or step.save is None or layer is None or step.save_stopped:
            return
        try:
            step.save_written = True
            if step.meta.loads and layer == self._last_layer:
                step.held_layer = layer  # the save cannot end before the loads are known good
                return
            step.save.layer_written(layer, timeout=self.config.op_timeout_s)
        except KVFlowError as exc:  # a save that cannot go on is dropped: a future miss
            log.warning("kvflow: the step's save stopped at %s: %s", layer_name, exc)
            step.save_stopped = True

    def wait_for_save(self) -> None:
        begun = trace.now() if trace.ENABLED else 0
        self._end_step(self._step)
        if begun:
            trace.complete("wait_for_save", begun, "step")

    def _end_step(self, step: Step | None) -> None:
        """End the step's transfers before vLLM may reuse its blocks: the load first (its
        failed blocks are reported), then the step before's save if it still runs, then this
        step's save, which is dropped when any load of the step failed on any tensor-parallel
        rank (its chunks may have been computed over a bad prefix), else waited for or left
        to end beside the next step (``save_waits``). In a step with a load the save holds
        its last layer until then, so it cannot end, and store its chunks, before."""
        if step is None or step.ended:
            return
        step.ended = True
        self._start_load()
        cut = forward_cut(step, self._last_layer, self.config.use_layerwise)
        if cut:
            stop_cut_step(step, self._last_layer, self._transfers)
        if step.load is not None or step.load_failed:
            self._finish_load(step)
        self._transfers.end_unfinished()  # the step before's save had this whole forward
        failed = step.load_failed
        if step.meta.loads and step.meta.saves and not cut:  # the same on every rank
            failed = failed_on_any_rank(failed, self.group.tp_size)
        if step.save is not None:
            if failed or step.save_stopped or not step.save_written:
                self._transfers.drop(step.save, "save")
            elif self._release_held(step):
                waits = step.meta.save_waits
                self._transfers.finish_save(step.save, step.meta.saves, wait=waits)
            if trace.ENABLED:
                trace.async_end("step_save", step.ident, "step")

    def _release_held(self, step: Step) -> bool:
        """Hand the held last layer to the save; False when the save stopped there."""
        assert step.save is not None
        if step.held_layer is None:
            return True
        try:
            step.save.layer_written(step.held_layer, timeout=self.config.op_timeout_s)
        except KVFlowError as exc:
            log.warning("kvflow: the step's save stopped at its last layer: %s", exc)
            self._transfers.drop(step.save, "save")
            return False
        return True

    def _finish_load(self, step: Step) -> None:
        result = self._transfers.result(step.load, "load") if step.load is not None else None
        planned = step.planned_loads()
        failed = self._transfers.load_failures(None if step.load_failed else result, planned)
        step.load_failed = bool(failed.size)
        self._load_errors.update(failed.tolist())
        if trace.ENABLED:
            trace.async_end("step_load", step.ident, "step", failed_blocks=len(failed))

    def get_block_ids_with_load_errors(self) -> set[int]:
        step = self._step
        if step is not None and step.load is not None and not step.ended:
            self._end_step(step)  # asked before wait_for_save (deferred finalize): end it now
        failed, self._load_errors = self._load_errors, set()
        return failed

    def clear(self) -> None:
        """After the step: end it if vLLM did not (``wait_for_save``), and forget it."""
        step, self._step = self._step, None
        self._end_step(step)  # a step vLLM did not end with wait_for_save

    def take_stats(self) -> KVFlowConnectorStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        self._async.close()
        self._transfers.close()
        if self._store is not None and self._owns_store:
            self._store.close()
        self._store = None
