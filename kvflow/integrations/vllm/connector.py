"""KVFlowConnector: kvflow as a vLLM KV connector (``KVConnectorBase_V1``).

vLLM builds the connector twice: in the engine-core process as the SCHEDULER, which decides hits
from one batched pool lookup of the request's own block hashes and plans each step's loads and
saves (``planner.ChunkPlanner``), and in each worker as the WORKER, which moves the bytes through
a SyncTransferEngine, layer by layer. They share no memory: the plan travels in
``KVFlowConnectorMetadata``.

Worker, per step: the metadata is bound before the forward. The step's load and save start at
the first of ``start_load_kv`` and the first per-layer hook (vLLM may call the hooks first);
neither waits for the pool's session, which opens while the first layers compute;
``wait_for_layer_load(layer)`` blocks until that layer is in place (or, with
``use_layerwise: false``, the whole load waits before layer 0). ``save_kv_layer(layer)`` hands a
layer of the step's newly completed chunks to the save as soon as attention wrote it.
``wait_for_save`` waits for the step's save and load to end (every wait bounded): vLLM may free
or reuse the blocks afterwards. Chunks that failed to load are reported by
``get_block_ids_with_load_errors``, and vLLM recomputes them (with ``kv_load_failure_policy:
"recompute"``) or fails the request (its default, ``"fail"``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvflow import trace
from kvflow.errors import KVFlowError, LayoutError
from kvflow.integrations.vllm.caches import (
    cache_layout,
    layer_backend,
    spec_fingerprint,
    vllm_cache_shape,
)
from kvflow.integrations.vllm.config import AUTO, ConnectorConfig
from kvflow.integrations.vllm.metrics import KVFlowConnectorStats, KVFlowPromMetrics
from kvflow.integrations.vllm.planner import ChunkPlanner, Transfer
from kvflow.integrations.vllm.support import check_supported
from kvflow.keys import ChunkHashes, KeySpace
from kvflow.layout import SKIP_BLOCK
from kvflow.pipeline.executor import call_pinned
from kvflow.pipeline.sync import SyncLoadHandle, SyncSaveHandle, SyncTransferEngine
from kvflow.pipeline.transfer import _STRAGGLER_GRACE
from kvflow.results import ChunkStatus, TransferResult
from kvflow.stores.base import Store, SupportsPrefixContext

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvflow.stores.local import LocalStore

__all__ = ["KVFlowConnector", "KVFlowConnectorMetadata", "KVFlowConnectorStats"]

log = logging.getLogger("kvflow")
# a backstop for creating a worker's pool client on the copy CPUs: each native call inside is
# bounded by the store's own timeout_s already
_STORE_OPEN_TIMEOUT_S = 120.0


def _log_like_vllm() -> None:
    """kvflow's log lines go where vLLM's go (its handlers), at INFO."""
    ours, theirs = logging.getLogger("kvflow"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


@dataclass
class KVFlowConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to the workers."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class _Step:
    """The worker's state for one step: its plan, and the transfers started from it."""

    def __init__(self, meta: KVFlowConnectorMetadata) -> None:
        self.meta = meta
        self.load: SyncLoadHandle | None = None
        self.save: SyncSaveHandle | None = None
        self.load_started = False
        self.load_failed = False  # some block of the load is lost (all, before its result)
        self.save_stopped = False
        self.save_written = False  # some layer reached the save (else the step had no forward)
        self.held_layer: int | None = None  # the last layer, held from the save (see _end_step)
        self.ended = False
        self.ident = id(self)  # the trace's id of the step's load and save spans


class KVFlowConnector(KVConnectorBase_V1):
    """kvflow's layerwise KV pool for vLLM. ``kv_transfer_config={"kv_connector":
    "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm", "kv_role":
    "kv_both", "kv_connector_extra_config": {...}}``; see ``ConnectorConfig`` for the keys.

    Concurrency: vLLM calls each side from one thread (the scheduler's loop; the worker's model
    thread). Worker hooks block at most ``op_timeout_s`` each (a stuck load costs one timeout
    per step, not one per layer); copies run on the engine's own threads. The scheduler's
    lookup blocks at most ``lookup_timeout_s``, and not at all while an earlier one hangs.
    Refused at start: what ``support.check_supported`` lists (several KV cache groups,
    attention with null blocks such as sliding windows, pipeline or decode-context
    parallelism, speculative decoding whose drafter has attention layers)."""

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
        assert kv_cache_config is not None, "this vLLM passes no kv_cache_config"
        check_supported(vllm_config, kv_cache_config)
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        group = kv_cache_config.kv_cache_groups[0]
        self._spec = group.kv_cache_spec
        self._block_size = int(self._spec.block_size)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._num_layers = len(group.layer_names)
        self._mla = isinstance(self._spec, MLAAttentionSpec)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._chunk_blocks = self.config.chunk_blocks_for(self._block_size)
        model = vllm_config.model_config
        revision = f"@{model.revision}" if getattr(model, "revision", None) else ""
        self._model = self.config.model or f"{model.model}{revision}"
        self._fingerprint = spec_fingerprint(
            self._spec, num_layers=self._num_layers, tp_size=self._tp_size
        )
        self._store: Store | None = None
        self._store_error: str | None = None
        self._copy_cpus: tuple[int, ...] = ()  # a worker's, set with its KV caches
        self._stats = KVFlowConnectorStats()  # this role's, drained by vLLM every step
        self._stats_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # -- common -------------------------------------------------------------------------------

    def _keyspace(self, rank: int) -> KeySpace:
        return KeySpace.for_layout(
            model=self._model,
            layout_fingerprint=self._fingerprint,
            chunk_blocks=self._chunk_blocks,
            num_layers=self._num_layers,
            rank=rank,
        )

    def _open_store(self, *, scheduler: bool, device: str = "cpu") -> Store | None:
        """The configured pool (for KV caches on ``device``), or None (logged) when it cannot
        be reached: then every lookup misses and nothing is saved, and vLLM runs as without
        the connector."""
        kind = self.config.store
        # Mooncake's client moves bytes on threads of its own: a worker's run on the copy CPUs
        # (the shared pool's server, which a store may start, is not pinned to one worker's)
        cpus = self._copy_cpus if kind == "mooncake" and not scheduler else ()
        try:
            store = call_pinned(
                cpus,
                _make_store,
                self.config,
                scheduler,
                device,
                timeout_s=_STORE_OPEN_TIMEOUT_S,
                on_late=Store.close,
            )
        except KVFlowError as exc:
            self._store_error = f"{type(exc).__name__}: {exc}"
            log.error("kvflow: the %s pool is unavailable (%s); running without it", kind, exc)
            return None
        log.info("kvflow: %s connector on the %s pool: %r", self.role.name.lower(), kind, store)
        return store

    def shutdown(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        if trace.ENABLED:
            trace.flush()  # vLLM may end this process without running its exit handlers

    # -- scheduler side -----------------------------------------------------------------------

    def _init_scheduler(self) -> None:
        self._store = self._open_store(scheduler=True)
        ranks = [0] if self._mla else list(range(self._tp_size))
        self._spaces = [self._keyspace(r) for r in ranks]
        self._planner = ChunkPlanner(
            block_size=self._block_size,
            chunk_blocks=self._chunk_blocks,
            lookup=self._lookup,
            load=self.config.load,
            save=self.config.save,
            # twice the chunks vLLM's cache holds: those it can serve, and recent others
            seen_limit=2 * self._num_blocks // self._chunk_blocks,
        )
        self._lookup_errors = 0
        self._asked = 0  # chunks looked up, so far
        self._lookups = _Bounded(self.config.lookup_timeout_s)

    def _lookup(self, hashes: list[bytes], preceding: list[bytes]) -> np.ndarray:
        """Per chunk: every rank's object stored. One store call for all ranks, bounded by
        ``lookup_timeout_s``; a failing pool is a miss. ``preceding``: the chunks before
        (vLLM's cache holds them), named to a pool that orders eviction by prefix."""
        if self._store is None or not hashes:
            return np.zeros(len(hashes), dtype=bool)
        keys = [k for space in self._spaces for k in space.keys(hashes)]
        lookup = self._store.lookup
        if preceding and isinstance(self._store, SupportsPrefixContext):
            context = [k for space in self._spaces for k in space.keys(preceding)]
            lookup = functools.partial(self._store.lookup_with_context, context=context)
        self._asked += len(hashes)
        begun = trace.now() if trace.ENABLED else 0
        try:
            found = self._lookups.call(lookup, keys)
        except Exception as exc:  # any failure of the pool is a miss, never the scheduler's
            self._lookup_errors += 1
            with self._stats_lock:
                self._stats.data["lookup_errors"] += 1
            log.warning("kvflow: pool lookup failed, counted as a miss: %r", exc)
            return np.zeros(len(hashes), dtype=bool)
        finally:
            if begun:
                trace.complete("lookup", begun, "scheduler", chunks=len(hashes))
        found = np.asarray(found, dtype=bool).reshape(len(self._spaces), len(hashes))
        return np.asarray(found.all(axis=0), dtype=bool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        asked = self._asked
        tokens = self._planner.matched_tokens(
            request.request_id,
            lambda: request.block_hashes,
            request.num_prompt_tokens,
            num_computed_tokens,
        )
        if self._asked > asked:  # the pool was asked
            with self._stats_lock:
                chunk_tokens = self._chunk_blocks * self._block_size
                self._stats.record_lookup((self._asked - asked) * chunk_tokens, tokens)
        return tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        begun = trace.now() if trace.ENABLED else 0
        meta = self._build_meta(scheduler_output)
        if begun:
            loads, saves = len(meta.loads), len(meta.saves)
            trace.complete("build_connector_meta", begun, "scheduler", loads=loads, saves=saves)
        return meta

    def _build_meta(self, scheduler_output: SchedulerOutput) -> KVFlowConnectorMetadata:
        n = scheduler_output.num_scheduled_tokens
        scheduled: list[tuple[str, Any, bool, int, int]] = [
            (r.req_id, r.block_ids[0], True, r.num_computed_tokens, n.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            scheduled.append(
                (
                    req_id,
                    new_ids[0] if new_ids is not None else None,
                    resumed,
                    cached.num_computed_tokens[i],
                    n.get(req_id, 0),
                )
            )
        loads, saves = self._planner.step(scheduled)
        return KVFlowConnectorMetadata(loads=loads, saves=saves)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._planner.finished(request.request_id)
        return False, None  # saves end within their step (wait_for_save)

    # -- worker side --------------------------------------------------------------------------

    def _init_worker(self) -> None:
        self._engine: SyncTransferEngine | None = None
        self._layer_index: dict[str, int] = {}
        self._step: _Step | None = None
        self._load_errors: set[int] = set()
        self._rank = 0
        self._saves_here = True
        self._block_bytes = 0  # one block, every layer
        self._debug_here = True  # the debug hooks act in this worker (config.debug_rank)
        self._last_layer = -1

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
        self._rank = 0 if self._mla else tp_rank
        self._saves_here = not (self._mla and tp_rank != 0)
        self._debug_here = self.config.debug_rank in (None, tp_rank)
        shape = None  # MLA: the shape vLLM's own cache spec gives each layer's tensor
        if self._mla and kv_caches:
            backend = layer_backend(self._vllm_config, next(iter(kv_caches)))
            shape = vllm_cache_shape(self._spec, self._num_blocks, backend)
        names, layout = cache_layout(
            kv_caches,
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            mla=self._mla,
            expected_shape=shape,
        )
        page = getattr(self._spec, "page_size_bytes", None)
        if page is not None and layout.layer_block_bytes(0) != int(page):
            raise LayoutError(
                "kv_caches",
                f"{layout.layer_block_bytes(0)} bytes per block and layer",
                f"vLLM's cache spec says {page}: kvflow does not know this layout",
            )
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._last_layer = len(names) - 1
        self._block_bytes = sum(layout.layer_block_bytes(i) for i in range(layout.num_layers))
        self._copy_cpus = self.config.copy_cpus_here(layout.device)  # vLLM has bound its threads
        model_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        log.info(
            "kvflow: worker copy threads on CPUs %s, the model thread on %s",
            list(self._copy_cpus) or "(not pinned)",
            model_cpus,
        )
        if self.config.copy_cpus == AUTO and self._copy_cpus and self._tp_size > 1:
            log.warning(
                'kvflow: copy_cpus "auto" with %d workers: the CPUs %s may be another '
                "worker's compute cores; list the reserved cores in copy_cpus",
                self._tp_size,
                list(self._copy_cpus),
            )
        self._store = self._open_store(scheduler=False, device=layout.device)
        if self._store is None:
            return
        engine_config = self.config.engine_config(
            block_size=self._block_size,
            model=self._model,
            rank=self._rank,
            copy_cpus=self._copy_cpus,
        )
        self._engine = SyncTransferEngine(
            layout, self._store, engine_config, keyspace=self._keyspace(self._rank)
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVFlowConnectorMetadata)
        self._step = _Step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        begun = trace.now() if trace.ENABLED else 0
        self._start_load()
        if begun:
            trace.complete("start_load_kv", begun, "step")

    def _start_load(self) -> _Step | None:
        """Start the step's transfers, once, at its first hook: the load, then the save (whose
        store session then opens while the first layers compute)."""
        step = self._step
        if step is None or step.load_started:
            return step
        step.load_started = True
        self._begin_load(step)
        self._begin_save(step)
        return step

    def _begin_load(self, step: _Step) -> None:
        if not step.meta.loads:
            return
        if self._engine is None:  # the scheduler planned loads this worker cannot make
            step.load_failed = True
            return
        requests = [
            (ChunkHashes(t.hashes, t.preceding), np.asarray(t.block_ids)) for t in step.meta.loads
        ]
        if trace.ENABLED:
            trace.async_begin("step_load", step.ident, "step", requests=len(requests))
        try:
            step.load = self._engine.start_load(requests)
        except KVFlowError as exc:
            log.warning("kvflow: the step's load did not start: %s", exc)
            step.load_failed = True
            return
        if not self.config.use_layerwise:  # everything before the forward
            for layer in range(self._num_layers):
                self._wait_layer(step, layer)

    def _begin_save(self, step: _Step) -> None:
        if self._engine is None or not step.meta.saves or not self._saves_here:
            return
        if self.config.debug_skip_saves and self._debug_here:
            return
        requests = [
            (ChunkHashes(t.hashes, t.preceding), np.asarray(t.block_ids)) for t in step.meta.saves
        ]
        if trace.ENABLED:
            trace.async_begin("step_save", step.ident, "step", requests=len(requests))
        try:
            step.save = self._engine.start_save(requests)
        except KVFlowError as exc:  # a save that cannot start is dropped: a future miss
            log.warning("kvflow: the step's save did not start: %s", exc)
            step.save_stopped = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._start_load()
        layer = self._layer_index.get(layer_name)
        if step is None or step.load is None or layer is None or not self.config.use_layerwise:
            return
        self._wait_layer(step, layer)

    def _wait_layer(self, step: _Step, layer: int) -> None:
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
        with self._stats_lock:
            self._stats.record_layer_wait(waited)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        step = self._start_load()
        layer = self._layer_index.get(layer_name)
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

    def _end_step(self, step: _Step | None) -> None:
        """End the step's transfers before vLLM may reuse its blocks: the load first (its
        failed blocks are reported), then the save, which is dropped when any load of the step
        failed on any tensor-parallel rank (its chunks may have been computed over a bad
        prefix). In a step with a load the save holds its last layer until then, so it cannot
        end, and store its chunks, before."""
        if step is None or step.ended:
            return
        step.ended = True
        self._start_load()
        if step.load is not None or step.load_failed:
            self._finish_load(step)
        failed = step.load_failed
        if step.meta.loads and step.meta.saves:  # the same on every rank: all of them agree
            failed = self._failed_on_any_rank(failed)
        if step.save is not None:
            if failed or step.save_stopped or not step.save_written:
                self._drop(step.save, "save")
            elif self._release_held(step):
                self._finish_save(step.save)
            if trace.ENABLED:
                trace.async_end("step_save", step.ident, "step")

    def _failed_on_any_rank(self, failed: bool) -> bool:
        """Whether the step's load failed on any tensor-parallel rank. Attention outputs are
        summed over the ranks, so the KV every rank computes in the step rests on every rank's
        loaded KV. One all-reduce on vLLM's CPU group of the tensor-parallel workers (bounded
        by its timeout), in steps that load and save."""
        if self._tp_size == 1:
            return failed
        from vllm.distributed.parallel_state import get_tp_group

        flag = torch.tensor([int(failed)], dtype=torch.int32)
        group = get_tp_group().cpu_group
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _release_held(self, step: _Step) -> bool:
        """Hand the held last layer to the save; False when the save stopped there."""
        assert step.save is not None
        if step.held_layer is None:
            return True
        try:
            step.save.layer_written(step.held_layer, timeout=self.config.op_timeout_s)
        except KVFlowError as exc:
            log.warning("kvflow: the step's save stopped at its last layer: %s", exc)
            self._drop(step.save, "save")
            return False
        return True

    def _finish_save(self, handle: SyncSaveHandle) -> None:
        backlog = handle.handle.backlog  # layers still to copy (it opened: layers came)
        result = self._result(handle, "save")
        tokens_per_chunk = self._chunk_blocks * self._block_size
        with self._stats_lock:
            d = self._stats.data
            d["saves"] += 1
            self._stats.record_save_backlog(backlog)
            if result is None:
                return
            ok, failed = result.count(ChunkStatus.OK), result.count(ChunkStatus.FAILED)
            d["saved_tokens"] += ok * tokens_per_chunk
            d["saved_bytes"] += ok * self._chunk_blocks * self._block_bytes
            skipped = result.count(ChunkStatus.EXISTS) + result.count(ChunkStatus.NO_SPACE)
            d["save_skipped_tokens"] += skipped * tokens_per_chunk
            d["save_failed_tokens"] += failed * tokens_per_chunk
            d["save_failed_chunks"] += failed

    def _finish_load(self, step: _Step) -> None:
        result = self._result(step.load, "load") if step.load is not None else None
        planned = [b for t in step.meta.loads for b in t.block_ids if b != SKIP_BLOCK]
        debug_fail = self.config.debug_fail_loads and self._debug_here
        if result is None or step.load_failed or debug_fail:
            failed = set(planned)
            step.load_failed = True
        else:
            failed = {int(b) for r in result.requests for b in r.failed_block_ids}
            step.load_failed = bool(failed)
            if self.config.debug_corrupt_loads and self._debug_here:
                self._corrupt(np.asarray([b for b in planned if b not in failed], dtype=np.int64))
        self._load_errors |= failed
        if trace.ENABLED:
            trace.async_end("step_load", step.ident, "step", failed_blocks=len(failed))
        with self._stats_lock:
            d = self._stats.data
            d["loads"] += 1
            d["loaded_tokens"] += (len(planned) - len(failed)) * self._block_size
            d["loaded_bytes"] += (len(planned) - len(failed)) * self._block_bytes
            d["load_failed_tokens"] += len(failed) * self._block_size
            d["load_failed_chunks"] += -(-len(failed) // self._chunk_blocks)

    def _result(
        self, handle: SyncLoadHandle | SyncSaveHandle | None, what: str
    ) -> TransferResult | None:
        """The transfer's result; None (the transfer dropped) when it does not come in time."""
        if handle is None:
            return None
        try:
            return handle.wait(timeout=self.config.op_timeout_s)
        except KVFlowError as exc:
            log.warning("kvflow: the step's %s did not finish: %s", what, exc)
            self._drop(handle, what)
            return None

    def _drop(self, handle: SyncLoadHandle | SyncSaveHandle, what: str) -> None:
        """Abort a transfer and wait until no copy of it can still touch the blocks (a copy past
        its timeout may still be running): vLLM reuses them once the step ends. If one is still
        running after the engine's grace, the connector stops moving bytes for good."""
        try:
            handle.close()
        except KVFlowError as exc:
            log.warning("kvflow: closing the step's %s: %s", what, exc)
        cfg = self.config
        deadline = time.monotonic() + _STRAGGLER_GRACE * cfg.copy_timeout_s + cfg.op_timeout_s
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not handle.done():
            log.critical(
                "kvflow: a %s copy is still running past its grace; the connector stops "
                "loading and saving in this process",
                what,
            )
            self._engine = None

    def _corrupt(self, blocks: np.ndarray) -> None:
        """Test hook (``debug_corrupt_loads``): overwrite loaded blocks with garbage."""
        assert self._engine is not None
        layout = self._engine.layout
        if layout.device != "cpu":
            log.warning("kvflow: debug_corrupt_loads works on CPU caches only; ignored")
            return
        for parts in layout.layers:
            for part in parts:
                for block in blocks.tolist():
                    ctypes.memset(part.base + block * part.block_stride, 0x7B, part.block_bytes)

    def get_block_ids_with_load_errors(self) -> set[int]:
        step = self._step
        if step is not None and step.load is not None and not step.ended:
            self._end_step(step)  # asked before wait_for_save (deferred finalize): end it now
        failed, self._load_errors = self._load_errors, set()
        return failed

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        step, self._step = self._step, None
        self._end_step(step)  # a step vLLM did not end with wait_for_save

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVFlowConnectorStats()
        return out

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


def _make_store(config: ConnectorConfig, scheduler: bool, device: str = "cpu") -> Store:
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


_LOCAL: dict[int, Store] = {}
_LOCAL_LOCK = threading.Lock()


def _local_store(capacity: int) -> Store:
    from kvflow.stores.local import LocalStore

    with _LOCAL_LOCK:
        store = _LOCAL.get(os.getpid())
        if store is None:
            store = _LOCAL[os.getpid()] = _SharedLocal(LocalStore(capacity))
        return store


class _SharedLocal(Store):
    """One process's embedded pool, shared by its scheduler and worker connectors; closing it
    is a no-op (it lives as long as the process)."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner = inner
        self.inline_metadata = inner.inline_metadata
        self.device_memory = inner.device_memory

    def register(self, regions: Any) -> None:
        self.inner.register(regions)

    def unregister(self, regions: Any) -> None:
        self.inner.unregister(regions)

    def lookup(self, keys: Any) -> np.ndarray:
        return self.inner.lookup(keys)

    def lookup_with_context(self, keys: Any, context: Any) -> np.ndarray:
        return self.inner.lookup_with_context(keys, context)

    def open_write_with_context(self, keys: Any, nbytes: int, context: Any) -> Any:
        return self.inner.open_write_with_context(keys, nbytes, context)

    def open_read_with_context(self, keys: Any, context: Any) -> Any:
        return self.inner.open_read_with_context(keys, context)

    def open_write(self, keys: Any, nbytes: int) -> Any:
        return self.inner.open_write(keys, nbytes)

    def finish_write(self, session: Any, ok: np.ndarray) -> None:
        self.inner.finish_write(session, ok)

    def open_read(self, keys: Any) -> Any:
        return self.inner.open_read(keys)

    def close_read(self, session: Any) -> None:
        self.inner.close_read(session)

    def batch_copy(self, pool_addrs: Any, local_addrs: Any, sizes: Any, direction: Any) -> Any:
        return self.inner.batch_copy(pool_addrs, local_addrs, sizes, direction)

    def __repr__(self) -> str:
        return f"process-wide {self.inner!r}"


class _Bounded:
    """Calls on a helper thread, each waited for at most ``timeout`` seconds. While a call that
    timed out is still running, the next ones fail at once: a hung pool costs the scheduler one
    timeout, not one per request and step, and never more than one thread."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._running: threading.Thread | None = None

    def call(self, fn: Any, arg: Any) -> Any:
        if self._running is not None and self._running.is_alive():
            raise TimeoutError("an earlier pool lookup has not returned yet")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(arg)
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=run, name="kvflow-lookup", daemon=True)
        self._running = thread
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise TimeoutError(f"pool lookup took more than {self.timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]
