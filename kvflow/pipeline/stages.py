"""BatchStages: one request batch's two tasks on the engine's loop, joined by a bounded queue:

    driver:    next layer (load: window slot free; save: layer written)
               -> the layer's ranges (NumPy; a save builds every layer's when it opens)
               -> batch_copy submitted to the copy executor (an inline save's: done already)
    completer: await each copy in order (with a timeout) -> record failed chunks
               -> set the layer's events -> after the last layer, end the batch

A driver that cannot go on (a producer or consumer silent for ``op_timeout_s``, or an error)
fails the batch and hands the completer the missing layers, so the completer always finishes and
the batch always ends (``BatchTransfer``, in ``transfer.py``, ends it: the store session, the
result, stragglers, closing).

Concurrency: both tasks run on the engine's loop; ``_copy`` runs on a copy thread, where it
writes only its own layer's ``loaded_tokens`` entry and sets its ``layer_events`` entry (a
``threading.Event``, for waiters on other threads), and reaches the loop's event through
``call_soon_threadsafe``. A save's layer may instead come to the driver ``Copied`` already, on
its producer's thread (``EngineConfig.inline_saves``): the driver then submits nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow import trace
from kvflow.errors import TransferTimeoutError
from kvflow.pipeline.addrgen import BatchAddresses, LayerRanges
from kvflow.pipeline.batch import BatchPlan
from kvflow.pipeline.runtime import Runtime
from kvflow.pipeline.waits import future_within
from kvflow.results import ChunkStatus
from kvflow.stores.base import Direction, PreparedWrites, ReadSession, WriteSession

__all__ = ["BatchStages", "Copied"]

log = logging.getLogger("kvflow")


@dataclass(frozen=True)
class Copied:
    """A save's layer copied on its producer's thread: the ranges the driver would have
    submitted, and how the copy ended (``_copy``'s failed range indices, or what it raised)."""

    ranges: LayerRanges | None
    failed: np.ndarray | None = None
    error: Exception | None = None

    def future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any] | None:
        """The copy as the completer settles it (None: nothing was copied)."""
        if self.ranges is None or not len(self.ranges):
            return None
        future = loop.create_future()
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result(self.failed)
        return future


class BatchStages:
    """The driver and completer of one batch (see the module docstring); BatchTransfer adds
    how the batch ends, LoadHandle and SaveHandle where its layers come from."""

    direction: Direction
    _blocks_stat: str  # the EngineStats counter of blocks moved

    def __init__(
        self,
        runtime: Runtime,
        plan: BatchPlan,
        session: ReadSession | WriteSession | None,
        active: np.ndarray,
        status: np.ndarray,
    ) -> None:
        self._runtime = runtime
        self._loop = asyncio.get_running_loop()
        self._plan = plan
        self._session = session
        self._active = active  # batch chunk indices that are copied
        self._status = status  # per batch chunk, final unless in `active`
        self._failed = np.zeros(active.shape[0], dtype=bool)  # per active chunk
        cfg = runtime.config
        self._addresses = (
            BatchAddresses(
                runtime.layout,
                plan.chunk_block_ids(active),
                session.addrs[active],
                cfg.chunk_blocks,
                cfg.transfer_limit,
            )
            if session is not None and active.size
            else None
        )
        self._built: list[LayerRanges] | None = None  # every layer's, where built at once
        self._prepared: PreparedWrites | None = None  # a save's copies of _built, checked once
        n = runtime.layout.num_layers
        self._events = [asyncio.Event() for _ in range(n)]
        self.layer_events = [threading.Event() for _ in range(n)]
        self.loaded_tokens: list[Any] = [None] * n  # DeviceOps.layer_loaded's token per layer
        self._queue: asyncio.Queue[tuple[int, LayerRanges | None, Any]] = asyncio.Queue(
            maxsize=self._window()
        )
        self._futures: list[asyncio.Future[Any]] = []  # every copy submitted
        self._submitted: list[concurrent.futures.Future[Any]] = []  # the same, as the executor's
        self._timed_out: set[asyncio.Future[Any]] = set()  # copies the completer gave up on
        self.last_error: BaseException | None = None
        self._before_start()
        self._tasks = [
            asyncio.ensure_future(self._drive()),
            asyncio.ensure_future(self._complete()),
        ]

    # -- to be provided by LoadHandle / SaveHandle, and BatchTransfer -------------------------

    def _before_start(self) -> None:
        """Called once the batch's addresses are known, before its tasks start."""

    def _window(self) -> int:
        raise NotImplementedError

    async def _next_layer(self) -> tuple[int, Any]:
        raise NotImplementedError

    def _layer_finished(self, layer: int) -> None:
        """Called by the completer after each layer (save: frees a backlog slot)."""

    async def _finish(self) -> None:
        """End the batch once the completer is through (BatchTransfer: store, result)."""
        raise NotImplementedError

    # -- the stages ---------------------------------------------------------------------------

    async def _drive(self) -> None:
        rt = self._runtime
        sent: set[int] = set()
        try:
            for _ in range(rt.layout.num_layers):
                layer, token = await self._next_layer()
                if isinstance(token, Copied):  # on the producer's thread, already
                    ranges, future = token.ranges, token.future(self._loop)
                else:
                    ranges, future = self._submit(layer, token)
                sent.add(layer)
                await self._queue.put((layer, ranges, future))
        except Exception as exc:  # the batch fails; the completer must still finish
            log.warning("kvflow: %s stopped: %s", type(self).__name__, exc, exc_info=True)
            self.last_error = exc
            self._failed[:] = True
            for layer in range(rt.layout.num_layers):
                if layer not in sent:
                    await self._queue.put((layer, None, None))

    def _submit(
        self, layer: int, token: Any
    ) -> tuple[LayerRanges | None, asyncio.Future[Any] | None]:
        """Hand the layer's copy to a copy thread (None: nothing to copy)."""
        ranges = self._ranges(layer)
        if ranges is None or not len(ranges):
            return ranges, None
        copy = self._runtime.copier.submit(self._copy, layer, ranges, token)
        self._submitted.append(copy)
        future = asyncio.wrap_future(copy)
        self._futures.append(future)
        return ranges, future

    def _ranges(self, layer: int) -> LayerRanges | None:
        if self._addresses is None:
            return None
        built = self._built
        ranges = built[layer] if built is not None else self._addresses.layer(layer)
        if np.count_nonzero(self._failed):  # a failed chunk is not copied again
            keep = ~self._failed[ranges.chunk]
            ranges = LayerRanges(
                ranges.local[keep], ranges.pool[keep], ranges.sizes[keep], ranges.chunk[keep]
            )
        return ranges

    def _copy(self, layer: int, ranges: LayerRanges, token: Any) -> np.ndarray:
        """On a copy thread (an inline save: the producer's): wait for the device, move the
        bytes, return failed range indices."""
        device = self._runtime.device
        loading = self.direction == Direction.FROM_POOL
        issued = False

        # asynchronous copies (CUDA): the consumer may go on once they are issued, its stream
        # waiting on their event; a failure found later still fails the chunks in the result
        def on_issued(loaded: Any) -> None:
            nonlocal issued
            issued = True
            self.loaded_tokens[layer] = loaded
            self.layer_events[layer].set()
            self._loop.call_soon_threadsafe(self._events[layer].set)

        if trace.ENABLED:
            start = trace.now()
        with device.copying(self.direction, token, on_issued if loading else None):
            prepared, built = self._prepared, self._built
            if prepared is not None and built is not None and ranges is built[layer]:
                failed = prepared.copy(layer)
            else:  # a load, or a save some of whose chunks failed already
                failed = self._runtime.store.batch_copy(
                    ranges.pool, ranges.local, ranges.sizes, self.direction
                )
        if trace.ENABLED:
            name = "load_copy" if loading else "save_copy"
            nbytes = int(ranges.sizes.sum())
            trace.complete(name, start, "copy", layer=layer, ranges=len(ranges), bytes=nbytes)
        if loading and not issued:
            self.loaded_tokens[layer] = device.layer_loaded(layer)
            if len(failed) == 0:  # the fast path: a waiting consumer wakes without a loop hop
                self.layer_events[layer].set()
        return failed

    async def _complete(self) -> None:
        n = self._runtime.layout.num_layers
        finished = np.zeros(n, dtype=bool)
        try:
            for _ in range(n):
                layer, ranges, future = await self._queue.get()
                if finished[layer]:  # a layer twice means another never came: nothing is whole
                    self._failed[:] = True
                finished[layer] = True
                if future is not None and ranges is not None:
                    await self._settle(layer, ranges, future)
                self._layer_finished(layer)
                self._events[layer].set()
                self.layer_events[layer].set()
            self._final_status()
        finally:
            await self._finish()

    def _final_status(self) -> None:
        self._status[self._active] = np.where(self._failed, ChunkStatus.FAILED, ChunkStatus.OK)
        stats = self._runtime.stats
        stats.failed_chunks += int(self._failed.sum())
        moved = self._plan.moved_blocks(self._active[~self._failed])
        setattr(stats, self._blocks_stat, getattr(stats, self._blocks_stat) + moved)

    async def _settle(self, layer: int, ranges: LayerRanges, future: asyncio.Future[Any]) -> None:
        stats = self._runtime.stats
        timeout = self._runtime.config.copy_timeout_s
        failed_chunks: np.ndarray
        done = future.done() and not future.cancelled() and future.exception() is None
        if done and not len(future.result()):  # the common case: no wait, no lookup
            self._count_copy(ranges, ranges.nbytes)
            return
        carried = np.unique(ranges.chunk)
        try:
            if not future.done() and self._failed[carried].all():
                # every chunk of this layer failed in an earlier one (a source that stopped
                # answering): not waited for again, so such a batch fails within one copy
                # timeout, not one per layer; the copy is a straggler like a timed-out one
                self._timed_out.add(future)
                failed_chunks = carried
            elif await future_within(future, timeout):
                failed = np.asarray(future.result(), dtype=np.int64)
                failed_chunks = np.unique(ranges.chunk[failed])
            else:
                self._timed_out.add(future)
                stats.timeouts += 1
                self.last_error = TransferTimeoutError(f"copy of layer {layer}", timeout)
                failed_chunks = carried
        except Exception as exc:  # a store failure is data: the layer's chunks fail
            log.warning("kvflow: copy of layer %d failed: %r", layer, exc, exc_info=True)
            self.last_error = exc
            failed_chunks = carried
        self._failed[failed_chunks] = True
        ok = ~np.isin(ranges.chunk, failed_chunks) if failed_chunks.size else None
        self._count_copy(ranges, ranges.nbytes if ok is None else int(ranges.sizes[ok].sum()))

    def _count_copy(self, ranges: LayerRanges, moved: int) -> None:
        stats = self._runtime.stats
        stats.copy_calls += 1
        stats.copy_ranges += len(ranges)
        if self.direction == Direction.TO_POOL:
            stats.bytes_saved += moved
        else:
            stats.bytes_loaded += moved
