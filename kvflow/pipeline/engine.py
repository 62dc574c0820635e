"""TransferEngine: the asyncio front of kvflow's layerwise pipeline.

Concurrency contract: an engine belongs to the event loop that first uses it; every coroutine
must be awaited on that loop (use SyncTransferEngine from other threads). Store metadata calls run
on one dedicated thread (or inline, microseconds, for in-process stores: ``Store.inline_metadata``)
and copies on the pinned copy executor, so no call blocks the loop. Every
wait has a timeout (``op_timeout_s`` for metadata and whole-batch waits, ``copy_timeout_s`` per
layer's copy). Call order: ``lookup`` (optional), then ``start_load``/``start_save`` (or the
whole-request ``load``/``save``), then ``close`` once. Cancelling a coroutine that owns a handle
(``load``, ``save``, or ``async with handle``), or one waiting in a handle's ``wait_layer``,
``layer_written`` or ``wait``, aborts the batch: its leases are released and its writes aborted
before the cancellation goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from kvflow.config import EngineConfig
from kvflow.copying.host import stream_min_bytes
from kvflow.devices import DeviceOps, device_kind, device_ops
from kvflow.errors import ClosedError, KVFlowError, LayoutError
from kvflow.keys import KeySpace, chunk_hashes, token_array
from kvflow.layout import KVLayout
from kvflow.pipeline.batch import BatchPlan, BlockRequest, plan_batch
from kvflow.pipeline.handles import LoadHandle, SaveHandle
from kvflow.pipeline.runtime import Runtime
from kvflow.pipeline.transfer import BatchTransfer
from kvflow.results import ChunkStatus, TransferResult
from kvflow.stats import EngineStats
from kvflow.stores.base import (
    ReadSession,
    Store,
    WriteSession,
    WriteStatus,
)

__all__ = ["TransferEngine"]

log = logging.getLogger("kvflow")
H = TypeVar("H", bound=BatchTransfer)


class TransferEngine:
    """Saves and loads KV between a KVLayout's device blocks and a Store, layer by layer.

    Per request batch the store sees one metadata call to open (``open_read``/``open_write``) and
    one to finish, whatever the number of layers; every layer is one ``batch_copy`` of coalesced
    address ranges. The engine does not own the store: close the store after the engine.
    """

    def __init__(
        self,
        layout: KVLayout,
        store: Store,
        config: EngineConfig | None = None,
        *,
        keyspace: KeySpace | None = None,
        device: DeviceOps | None = None,
    ) -> None:
        """``keyspace``: the keys' namespace, for integrations whose keys are also made in
        another process that has no layout (an inference server's scheduler); by default it
        comes from the model name, the layout's fingerprint, the chunk size and the rank.
        ``device``: how transfers are ordered with the caller's compute (by default
        ``device_ops(layout.device)``: no-ops on CPU, streams and events on accelerators)."""
        self.layout = layout
        self.store = store
        self.config = config or EngineConfig()
        self.keyspace = keyspace or KeySpace.for_layout(
            model=self.config.model,
            layout_fingerprint=layout.fingerprint(),
            chunk_blocks=self.config.chunk_blocks,
            num_layers=layout.num_layers,
            rank=self.config.rank,
        )
        self.device = device or device_ops(layout.device)
        if device_kind(layout.device) not in store.device_memory:
            raise LayoutError(
                "device",
                layout.device,
                f"{type(store).__name__} copies {'/'.join(sorted(store.device_memory))} memory "
                "only (Store.device_memory)",
            )
        if device_kind(layout.device) == "cpu":  # the host copy loop's choice, made now
            stream_min_bytes()  # (once per process) rather than in the first load
        self._closed = False
        store.register(layout.regions())
        self._runtime = Runtime(layout, store, self.config, self.device)
        self._stats = self._runtime.stats

    # -- public operations --------------------------------------------------------------------

    async def lookup(self, token_ids: Any) -> int:
        """Tokens of ``token_ids`` whose KV the pool holds: the leading run of stored chunks.

        A store that fails or times out counts as a miss (``stats().lookup_errors``).
        """
        self._check_open()
        tokens = token_array(token_ids)
        chunk_tokens = self.config.chunk_blocks * self.layout.block_size
        keys = self.keyspace.keys(chunk_hashes(tokens, chunk_tokens))
        self._stats.lookups += 1
        if not keys:
            return 0
        try:
            found = await self._runtime.meta(self.store.lookup, keys)
        except KVFlowError as exc:
            log.warning("kvflow: lookup failed, counted as a miss: %s", exc)
            self._stats.lookup_errors += 1
            self._stats.miss_chunks += len(keys)
            return 0
        found = np.asarray(found, dtype=bool)
        misses = np.flatnonzero(~found)
        hits = int(misses[0]) if misses.size else len(keys)
        self._stats.hit_chunks += hits
        self._stats.miss_chunks += len(keys) - hits
        return hits * chunk_tokens

    async def start_load(self, requests: Sequence[BlockRequest | tuple[Any, Any]]) -> LoadHandle:
        """Start loading a batch of ``BlockRequest(token_ids, block_ids)``; returns at once.

        Every full chunk of each request is loaded into its blocks. Chunks not in the pool come
        back MISSING, chunks whose copy fails FAILED: their blocks must be recomputed. Use as
        ``async with await engine.start_load(batch) as load:`` (see ``LoadHandle``).
        """
        return await self.open_load(self.plan(requests, load=True), self.device.load_started())

    async def open_load(self, plan: BatchPlan, ready: Any = None) -> LoadHandle:
        """The store half of ``start_load``, for a plan made (and checked) already by ``plan``;
        ``ready`` is ``DeviceOps.load_started``'s token from the caller's thread. Internal to
        kvflow (SyncTransferEngine plans on its caller's thread and opens on the loop)."""
        self._check_open()
        status = np.full(plan.num_chunks, ChunkStatus.FAILED, dtype=np.int8)
        session = None
        if plan.num_chunks:
            try:
                store = self.store
                if plan.context:  # the chunks before: the store orders eviction by them
                    session = await self._runtime.meta(
                        store.open_read_with_context,
                        plan.keys,
                        plan.context,
                        on_late=self._runtime.late_read,
                    )
                else:
                    late = self._runtime.late_read
                    session = await self._runtime.meta(store.open_read, plan.keys, on_late=late)
            except KVFlowError as exc:
                self._stats.store_errors += 1
                self._stats.failed_chunks += plan.num_chunks
                log.warning("kvflow: open_read failed; the batch's chunks fail: %s", exc)
        active = np.zeros(0, dtype=np.int64)
        if session is not None:
            found = np.asarray(session.found, dtype=bool)
            status[~found] = ChunkStatus.MISSING
            active = np.flatnonzero(found)
            self._stats.load_missing_chunks += int((~found).sum())
        self._stats.loads += 1
        handle = self._track(LoadHandle, plan, session, active, status)
        handle.ready = ready  # read by its first layer, on the loop, after this returns
        return handle

    async def start_save(self, requests: Sequence[BlockRequest | tuple[Any, Any]]) -> SaveHandle:
        """Start saving a batch of ``BlockRequest(token_ids, block_ids)``; returns at once.

        Only full chunks are saved; chunks already stored come back EXISTS, chunks that found no
        room NO_SPACE (skipped, counted). Objects become visible after the last layer. Use as
        ``async with await engine.start_save(batch) as save:`` (see ``SaveHandle``).
        """
        return await self.open_save(self.plan(requests, load=False))

    async def open_save(self, plan: BatchPlan) -> SaveHandle:
        """The store half of ``start_save``, for a plan made (and checked) already by ``plan``.
        Internal to kvflow, as ``open_load``."""
        self._check_open()
        status = np.full(plan.num_chunks, ChunkStatus.FAILED, dtype=np.int8)
        session = None
        nbytes = self.layout.object_bytes(self.config.chunk_blocks)
        if plan.num_chunks:
            try:
                store = self.store
                if plan.context:
                    session = await self._runtime.meta(
                        store.open_write_with_context,
                        plan.keys,
                        nbytes,
                        plan.context,
                        on_late=self._runtime.late_write,
                    )
                else:
                    session = await self._runtime.meta(
                        store.open_write, plan.keys, nbytes, on_late=self._runtime.late_write
                    )
            except KVFlowError as exc:
                self._stats.store_errors += 1
                self._stats.failed_chunks += plan.num_chunks
                log.warning("kvflow: open_write failed; the batch is not saved: %s", exc)
        active = np.zeros(0, dtype=np.int64)
        if session is not None:
            st = np.asarray(session.status)
            status[st == WriteStatus.EXISTS] = ChunkStatus.EXISTS
            status[st == WriteStatus.NO_SPACE] = ChunkStatus.NO_SPACE
            active = np.flatnonzero(st == WriteStatus.GRANTED)
            self._stats.saves_skipped_exists += int((st == WriteStatus.EXISTS).sum())
            self._stats.saves_skipped_no_space += int((st == WriteStatus.NO_SPACE).sum())
        self._stats.saves += 1
        return self._track(SaveHandle, plan, session, active, status)

    async def load(self, token_ids: Any, block_ids: Any) -> TransferResult:
        """Load one request, all layers; returns which blocks succeeded and which failed.

        A copy past its timeout may still write the failed blocks after this returns; before
        handing them to another request, load with ``start_load`` and ``aclose(wait=True)``
        (which waits for such a copy, within the engine's grace), as the vLLM connector does."""
        async with await self.start_load([BlockRequest(token_ids, block_ids)]) as handle:
            return await handle.wait()

    async def save(self, token_ids: Any, block_ids: Any) -> TransferResult:
        """Save one request's full chunks, all layers (its KV must already be written)."""
        async with await self.start_save([BlockRequest(token_ids, block_ids)]) as handle:
            for layer in range(self.layout.num_layers):
                await handle.layer_written(layer)
            return await handle.wait()

    def stats(self) -> EngineStats:
        """A copy of the counters."""
        return self._stats.snapshot()

    async def close(self) -> None:
        """Abort open batches (their chunks fail), release the store, stop the threads."""
        if self._closed:
            return
        self._closed = True
        await self._runtime.shielded(self._runtime.close())

    async def __aenter__(self) -> TransferEngine:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        s, rt = self._stats, self._runtime
        return (
            f"TransferEngine(layers={self.layout.num_layers}, open_batches={len(rt.batches)}, "
            f"copier={rt.copier!r}, copy_calls={s.copy_calls}, "
            f"metadata_calls={s.store_metadata_calls}, closed={self._closed})"
        )

    # -- internal to kvflow ---------------------------------------------------------------------

    def plan(self, requests: Sequence[BlockRequest | tuple[Any, Any]], *, load: bool) -> BatchPlan:
        """Check and key a batch for ``open_load`` / ``open_save`` (pure: no store call);
        raises ClosedError once the engine is closed. Internal to kvflow, as ``open_load``."""
        self._check_open()
        return plan_batch(self.layout, self.keyspace, requests, self.config.chunk_blocks, load=load)

    def _track(self, cls: type[H], plan: BatchPlan, session: Any, *args: Any) -> H:
        """Build a handle; if that fails (or the engine closed while the session opened), the
        session it was given is released first."""
        try:
            self._check_open()
            handle = cls(self._runtime, plan, session, *args)
        except BaseException:
            if isinstance(session, ReadSession):
                self._runtime.late_read(session)
            elif isinstance(session, WriteSession):
                self._runtime.late_write(session)
            raise
        self._runtime.batches.add(handle)
        return handle

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("TransferEngine")
