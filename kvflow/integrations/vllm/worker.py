"""KVFlowConnectorWorker: the connector's worker side, in each of vLLM's worker processes.

It moves the bytes the scheduler's plan names (``KVFlowConnectorMetadata``) between vLLM's KV
cache blocks and the pool, through a ``SyncTransferEngine``, layer by layer: a step's load and
save start at its first hook (``start_load_kv`` or the first per-layer one: vLLM may call the
hooks first), and neither waits for the pool's session, which opens while the first layers
compute. ``wait_for_layer_load(layer)`` blocks until that layer is in place (with
``use_layerwise: false`` the whole load waits before layer 0); ``save_kv_layer(layer)`` hands
each layer of the step's completed chunks to the save as soon as attention wrote it;
``wait_for_save`` ends the step, after which vLLM may reuse its blocks. Chunks that failed to
load are reported by ``get_block_ids_with_load_errors``.

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
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from kvflow import trace
from kvflow.errors import KVFlowError, LayoutError
from kvflow.integrations.vllm.caches import cache_layout, layer_backend, vllm_cache_shape
from kvflow.integrations.vllm.config import AUTO
from kvflow.integrations.vllm.metrics import KVFlowConnectorStats, StatsInterval
from kvflow.integrations.vllm.pools import open_pool
from kvflow.keys import ChunkHashes
from kvflow.layout import SKIP_BLOCK
from kvflow.pipeline.runtime import STRAGGLER_GRACE as _STRAGGLER_GRACE
from kvflow.pipeline.sync import SyncLoadHandle, SyncSaveHandle, SyncTransferEngine
from kvflow.results import ChunkStatus, TransferResult

if TYPE_CHECKING:
    from kvflow.integrations.vllm.caches import CacheGroup
    from kvflow.integrations.vllm.config import ConnectorConfig
    from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
    from kvflow.integrations.vllm.planner import Transfer
    from kvflow.layout import KVLayout
    from kvflow.stores.base import Store

__all__ = ["KVFlowConnectorWorker"]

log = logging.getLogger("kvflow")

H = TypeVar("H", SyncLoadHandle, SyncSaveHandle)


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
        self.hooked_layer = -1  # the last layer the forward reached (a per-layer hook came)
        self.ended = False
        self.ident = id(self)  # the trace's id of the step's load and save spans


class _AsyncLoad:
    """One request's asynchronous load: its handle (None: it could not start) and plan."""

    def __init__(self, handle: SyncLoadHandle | None, transfer: Transfer) -> None:
        self.handle = handle
        self.transfer = transfer
        self.started = time.monotonic()


class KVFlowConnectorWorker:
    """The worker side of ``KVFlowConnector``: one worker's loads and saves, step by step."""

    def __init__(self, config: ConnectorConfig, group: CacheGroup, vllm_config: Any) -> None:
        self.config = config
        self.group = group
        self.vllm_config = vllm_config
        self._store: Store | None = None
        self._engine: SyncTransferEngine | None = None
        self._copy_cpus: tuple[int, ...] = ()  # set with the KV caches
        self._layer_index: dict[str, int] = {}
        self._step: _Step | None = None
        self._async: dict[str, _AsyncLoad] = {}  # by request id
        self._load_errors: set[int] = set()
        self._rank = 0
        self._saves_here = True
        self._block_bytes = 0  # one block, every layer
        self._debug_here = True  # the debug hooks act in this worker (config.debug_rank)
        self._last_layer = -1
        self._stats = StatsInterval()
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
        self._debug_here = self.config.debug_rank in (None, tp_rank)
        names, layout = self._layout(kv_caches)
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
        self._engine = SyncTransferEngine(
            layout, self._store, engine_config, keyspace=self.group.keyspace(self._rank)
        )

    def _layout(self, kv_caches: dict[str, torch.Tensor]) -> tuple[list[str], KVLayout]:
        """The layer names and the layout of vLLM's tensors, which must hold the bytes per
        block vLLM's cache spec says (and, with MLA, have the shape it gives its layers)."""
        shape = None  # MLA: the shape vLLM's own cache spec gives each layer's tensor
        if self.group.mla and kv_caches:
            backend = layer_backend(self.vllm_config, next(iter(kv_caches)))
            shape = vllm_cache_shape(self.group.spec, self.group.num_blocks, backend)
        names, layout = cache_layout(
            kv_caches,
            num_blocks=self.group.num_blocks,
            block_size=self.group.block_size,
            mla=self.group.mla,
            expected_shape=shape,
        )
        page = getattr(self.group.spec, "page_size_bytes", None)
        if page is not None and layout.layer_block_bytes(0) != int(page):
            raise LayoutError(
                "kv_caches",
                f"{layout.layer_block_bytes(0)} bytes per block and layer",
                f"vLLM's cache spec says {page}: kvflow does not know this layout",
            )
        return names, layout

    def bind(self, meta: KVFlowConnectorMetadata) -> None:
        """The step's plan, before its forward."""
        self._step = _Step(meta)

    def start_load_kv(self) -> None:
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
        self._begin_async_loads(step)
        return step

    def _begin_load(self, step: _Step) -> None:
        if not step.meta.loads:
            return
        if self._engine is None:  # the scheduler planned loads this worker cannot make
            step.load_failed = True
            return
        step.load = self._start(step, "load", step.meta.loads, self._engine.start_load)
        if step.load is None:
            step.load_failed = True
            return
        if not self.config.use_layerwise:  # everything before the forward
            for layer in range(self.group.num_layers):
                self._wait_layer(step, layer)

    def _begin_async_loads(self, step: _Step) -> None:
        """Start the plan's asynchronous loads, each with its prefetch window lifted: no layer
        wait paces them, ``finished_async_loads`` reads them in later steps."""
        for t in step.meta.async_loads:
            handle = None
            if self._engine is not None:
                try:
                    handle = self._engine.start_load(
                        [(ChunkHashes(t.hashes, t.preceding), np.asarray(t.block_ids))]
                    )
                    handle.load_all()
                except KVFlowError as exc:
                    log.warning("kvflow: a load of %s did not start: %s", t.req_id, exc)
                    if handle is not None:  # started, then not let run: stopped, and failed
                        self._drop(handle, "asynchronous load")
                    handle = None
            self._async[t.req_id] = _AsyncLoad(handle, t)

    def finished_async_loads(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous load ended since the last call, and of those the
        ones whose load failed (any block: vLLM computes them from the first token). A load
        still running ``op_timeout_s`` after it started is stopped and failed; nothing else
        here waits."""
        finished: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for req_id, load in list(self._async.items()):
            handle = load.handle
            running = handle is not None and not handle.done()
            if running and now - load.started < self.config.op_timeout_s:
                continue
            del self._async[req_id]
            finished.add(req_id)
            if handle is None:
                result = None
            elif running:
                log.warning("kvflow: the load of %s is late; stopped", req_id)
                self._drop(handle, "load")
                result = None
            else:
                result = self._result(handle, "load")  # out already: no wait
            planned = np.asarray(load.transfer.block_ids, dtype=np.int64)
            if self._load_failures(result, planned[planned != SKIP_BLOCK]).size:
                failed.add(req_id)
        return finished, failed

    def _begin_save(self, step: _Step) -> None:
        if self._engine is None or not step.meta.saves or not self._saves_here:
            return
        if self.config.debug_skip_saves and self._debug_here:
            return
        step.save = self._start(step, "save", step.meta.saves, self._engine.start_save)
        step.save_stopped = step.save is None  # a save that cannot start is dropped: a future miss

    @staticmethod
    def _start(
        step: _Step, what: str, transfers: Sequence[Transfer], start: Callable[..., H]
    ) -> H | None:
        """Start the step's load or save of ``transfers``; None (logged) when it cannot start."""
        requests = [
            (ChunkHashes(t.hashes, t.preceding), np.asarray(t.block_ids)) for t in transfers
        ]
        if trace.ENABLED:
            trace.async_begin(f"step_{what}", step.ident, "step", requests=len(requests))
        try:
            return start(requests)
        except KVFlowError as exc:
            log.warning("kvflow: the step's %s did not start: %s", what, exc)
            return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._start_load()
        layer = self._layer_index.get(layer_name)
        if step is not None and layer is not None:
            step.hooked_layer = max(step.hooked_layer, layer)
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
        cut = self._forward_cut(step)
        if cut:
            self._stop_cut_step(step)
        if step.load is not None or step.load_failed:
            self._finish_load(step)
        failed = step.load_failed
        if step.meta.loads and step.meta.saves and not cut:  # the same on every rank
            failed = self._failed_on_any_rank(failed)
        if step.save is not None:
            if failed or step.save_stopped or not step.save_written:
                self._drop(step.save, "save")
            elif self._release_held(step):
                self._finish_save(step.save)
            if trace.ENABLED:
                trace.async_end("step_save", step.ident, "step")

    def _forward_cut(self, step: _Step) -> bool:
        """Whether the step's forward stopped before its last layer: it raised, and vLLM ends
        the step all the same. Every layer of a forward calls a hook, and only a step with
        scheduled tokens (a forward) has a load that layer waits pace."""
        if step.hooked_layer >= 0:
            return step.hooked_layer < self._last_layer
        return bool(step.meta.loads) and step.load is not None and self.config.use_layerwise

    def _stop_cut_step(self, step: _Step) -> None:
        """Stop a cut step's transfers at once, without waiting for layers that will never
        come: its load is dropped (every block reported failed), its save too (it holds layers
        of a forward that did not end: never stored)."""
        log.warning(
            "kvflow: the step's forward stopped after layer %d of %d; its load and save stopped",
            step.hooked_layer,
            self._last_layer,
        )
        if step.load is not None:
            self._drop(step.load, "load")
            step.load, step.load_failed = None, True
        step.save_stopped = True  # dropped below, with the save of any failed step

    def _failed_on_any_rank(self, failed: bool) -> bool:
        """Whether the step's load failed on any tensor-parallel rank. Attention outputs are
        summed over the ranks, so the KV every rank computes in the step rests on every rank's
        loaded KV. One all-reduce on vLLM's CPU group of the tensor-parallel workers (bounded
        by its timeout), in steps that load and save."""
        if self.group.tp_size == 1:
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
        tokens_per_chunk = self.group.chunk_blocks * self.group.block_size
        with self._stats.update() as stats:
            d = stats.data
            d["saves"] += 1
            stats.record_save_backlog(backlog)
            if result is None:
                return
            ok, failed = result.count(ChunkStatus.OK), result.count(ChunkStatus.FAILED)
            d["saved_tokens"] += ok * tokens_per_chunk
            d["saved_bytes"] += ok * self.group.chunk_blocks * self._block_bytes
            skipped = result.count(ChunkStatus.EXISTS) + result.count(ChunkStatus.NO_SPACE)
            d["save_skipped_tokens"] += skipped * tokens_per_chunk
            d["save_failed_tokens"] += failed * tokens_per_chunk
            d["save_failed_chunks"] += failed

    def _finish_load(self, step: _Step) -> None:
        result = self._result(step.load, "load") if step.load is not None else None
        every = [np.asarray(t.block_ids, dtype=np.int64) for t in step.meta.loads]
        planned = np.concatenate(every) if every else np.zeros(0, np.int64)
        planned = planned[planned != SKIP_BLOCK]
        failed = self._load_failures(None if step.load_failed else result, planned)
        step.load_failed = bool(failed.size)
        self._load_errors.update(failed.tolist())
        if trace.ENABLED:
            trace.async_end("step_load", step.ident, "step", failed_blocks=len(failed))

    def _load_failures(self, result: TransferResult | None, planned: np.ndarray) -> np.ndarray:
        """The ``planned`` blocks of an ended load that failed, counted in the stats: all of
        them without a result (or with ``debug_fail_loads``), else those the result names
        (``debug_corrupt_loads`` then garbles the others)."""
        if result is None or (self.config.debug_fail_loads and self._debug_here):
            failed = planned
        else:
            failed = result.failed_block_ids
            if self.config.debug_corrupt_loads and self._debug_here:
                self._corrupt(planned[~np.isin(planned, failed)])
        with self._stats.update() as stats:
            d = stats.data
            d["loads"] += 1
            d["loaded_tokens"] += (len(planned) - len(failed)) * self.group.block_size
            d["loaded_bytes"] += (len(planned) - len(failed)) * self._block_bytes
            d["load_failed_tokens"] += len(failed) * self.group.block_size
            d["load_failed_chunks"] += -(-len(failed) // self.group.chunk_blocks)
        return failed

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

    def clear(self) -> None:
        """After the step: end it if vLLM did not (``wait_for_save``), and forget it."""
        step, self._step = self._step, None
        self._end_step(step)  # a step vLLM did not end with wait_for_save

    def take_stats(self) -> KVFlowConnectorStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        for load in self._async.values():
            if load.handle is not None:
                load.handle.close()
        self._async.clear()
        if self._engine is not None:
            self._engine.close()
        if self._store is not None and self._owns_store:
            self._store.close()
        self._store = None
