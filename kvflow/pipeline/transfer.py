"""One request batch moving through the stages, layer by layer (the base of both handles).

A batch runs two tasks on the engine's loop, joined by a bounded queue:

    driver:    next layer (load: window slot free; save: layer written)
               -> address generation (NumPy) -> batch_copy submitted to the copy executor
    completer: await each copy in order (with a timeout) -> record failed chunks
               -> set the layer's events -> after the last layer, commit or release in the store

A driver that cannot go on (a producer or consumer silent for ``op_timeout_s``, or an error)
fails the batch and hands the completer the missing layers, so the completer always finishes and
the store is always released. Cleanup runs as a task of its own, awaited through
``asyncio.shield``: cancelling the caller, even twice, cannot cut it short.

A caller cancelled in one of the handle's waits (``wait_layer``, ``layer_written``, ``wait``)
aborts the batch there, as ``aclose`` does: copies not yet begun never start, and the leases,
pending writes and slots come back before the cancellation goes on, not after ``op_timeout_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from kvflow import trace
from kvflow._validate import check_timeout
from kvflow.errors import KVFlowError, TransferTimeoutError
from kvflow.pipeline.addrgen import BatchAddresses, LayerRanges
from kvflow.pipeline.batch import BatchPlan
from kvflow.pipeline.runtime import STRAGGLER_GRACE, Runtime
from kvflow.pipeline.waits import event_within, future_within
from kvflow.results import ChunkStatus, TransferResult
from kvflow.stores.base import Direction, ReadSession, WriteSession

__all__ = ["BatchTransfer"]

log = logging.getLogger("kvflow")
H = TypeVar("H", bound="BatchTransfer")
T = TypeVar("T")


class BatchTransfer:
    """The shared machinery of LoadHandle and SaveHandle (see the module docstring)."""

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
        self._finish_task: asyncio.Task[None] | None = None
        self._result_ready = asyncio.Event()
        self._done = asyncio.Event()
        self._result: TransferResult | None = None
        self._published = threading.Event()
        self._settled = False  # _finish_once has begun: the chunk statuses are final
        self._closed = False
        self.last_error: BaseException | None = None
        self._tasks = [
            asyncio.ensure_future(self._drive()),
            asyncio.ensure_future(self._complete()),
        ]

    # -- to be provided by LoadHandle / SaveHandle --------------------------------------------

    def _window(self) -> int:
        raise NotImplementedError

    async def _next_layer(self) -> tuple[int, Any]:
        raise NotImplementedError

    def _layer_finished(self, layer: int) -> None:
        """Called by the completer after each layer (save: frees a backlog slot)."""

    def _release_call(self) -> tuple[Any, tuple[Any, ...]] | None:
        """The store call that ends the session (commit or release) and its arguments."""
        raise NotImplementedError

    def _handed_over(self) -> bool:
        """Every layer is in the batch's hands (waited for, or written): it ends without the
        caller."""
        raise NotImplementedError

    async def _release(self) -> None:
        """End the store session. If the store says it could not (the pool went away, a lease
        ran past its limit), nothing of the batch is trusted: its chunks fail."""
        call = self._release_call()
        if call is None:
            return
        fn, args = call
        try:
            await self._runtime.meta(fn, *args)
        except KVFlowError as exc:
            log.warning("kvflow: %s could not end its store session: %s", type(self).__name__, exc)
            stats = self._runtime.stats
            stats.store_errors += 1
            ok_before = int((~self._failed).sum())
            moved = self._plan.moved_blocks(self._active[~self._failed])
            self._failed[:] = True
            self._status[self._active] = ChunkStatus.FAILED
            stats.failed_chunks += ok_before
            setattr(stats, self._blocks_stat, getattr(stats, self._blocks_stat) - moved)

    # -- the stages ---------------------------------------------------------------------------

    async def _drive(self) -> None:
        rt = self._runtime
        sent: set[int] = set()
        try:
            for _ in range(rt.layout.num_layers):
                layer, token = await self._next_layer()
                ranges = self._ranges(layer)
                future = None
                if ranges is not None and len(ranges):
                    copy = rt.copier.submit(self._copy, layer, ranges, token)
                    self._submitted.append(copy)
                    future = asyncio.wrap_future(copy)
                    self._futures.append(future)
                sent.add(layer)
                await self._queue.put((layer, ranges, future))
        except Exception as exc:  # the batch fails; the completer must still finish
            log.warning("kvflow: %s stopped: %s", type(self).__name__, exc, exc_info=True)
            self.last_error = exc
            self._failed[:] = True
            for layer in range(rt.layout.num_layers):
                if layer not in sent:
                    await self._queue.put((layer, None, None))

    def _ranges(self, layer: int) -> LayerRanges | None:
        if self._addresses is None:
            return None
        ranges = self._addresses.layer(layer)
        if self._failed.any():  # a failed chunk is not copied again
            keep = ~self._failed[ranges.chunk]
            ranges = LayerRanges(
                ranges.local[keep], ranges.pool[keep], ranges.sizes[keep], ranges.chunk[keep]
            )
        return ranges

    def _copy(self, layer: int, ranges: LayerRanges, token: Any) -> np.ndarray:
        """On a copy thread: wait for the device, move the bytes, return failed range indices."""
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
        try:
            if await future_within(future, timeout):
                failed = np.asarray(future.result(), dtype=np.int64)
                failed_chunks = np.unique(ranges.chunk[failed])
            else:
                self._timed_out.add(future)
                stats.timeouts += 1
                self.last_error = TransferTimeoutError(f"copy of layer {layer}", timeout)
                failed_chunks = np.unique(ranges.chunk)
        except Exception as exc:  # a store failure is data: the layer's chunks fail
            log.warning("kvflow: copy of layer %d failed: %r", layer, exc, exc_info=True)
            self.last_error = exc
            failed_chunks = np.unique(ranges.chunk)
        self._failed[failed_chunks] = True
        stats.copy_calls += 1
        stats.copy_ranges += len(ranges)
        ok = ~np.isin(ranges.chunk, failed_chunks) if failed_chunks.size else None
        moved = ranges.nbytes if ok is None else int(ranges.sizes[ok].sum())
        if self.direction == Direction.TO_POOL:
            stats.bytes_saved += moved
        else:
            stats.bytes_loaded += moved

    async def _finish(self) -> None:
        """Run ``_finish_once`` exactly once, as a task every caller awaits (shielded)."""
        if self._finish_task is None:
            self._finish_task = self._runtime.background(self._finish_once())
        await asyncio.shield(self._finish_task)

    async def _finish_once(self) -> None:
        """Publish the result, then release store resources once.

        Normally the store is updated first (a saved object is visible when ``wait()`` returns).
        A copy that timed out may still be running in its thread: its slot or lease is kept until
        it returns (bounded by a grace period), so the store never reuses memory under it; then
        the result is published first, so no caller waits for a straggler.
        """
        if self._settled:
            return
        self._settled = True
        unsettled = [f for f in self._futures if not f.done() and f not in self._timed_out]
        if unsettled:  # a closed batch's copies in flight: they normally end in microseconds
            await asyncio.wait(unsettled, timeout=self._runtime.config.copy_timeout_s)
        pending = [f for f in self._futures if not f.done()]
        if pending:
            self._publish()
            self._runtime.background(self._release_after(pending))
            return
        try:
            await self._release()  # a save's objects are visible before its result is
        finally:
            self._runtime.batches.discard(self)
            self._publish()
            self._done.set()

    def _publish(self) -> None:
        self._result = self._plan.result(self._status)
        self._result_ready.set()
        self._published.set()  # the result, for other threads: no loop hop to read it

    async def _release_after(self, pending: list[asyncio.Future[Any]]) -> None:
        grace = STRAGGLER_GRACE * self._runtime.config.copy_timeout_s
        _, late = await asyncio.wait(pending, timeout=grace)
        if late:
            log.error(
                "kvflow: %d copies still running after %.0f s; their store resources stay held",
                len(late),
                grace,
            )
            self._runtime.batches.discard(self)
            self._done.set()
            return
        try:
            await self._release()
        finally:
            self._runtime.batches.discard(self)
            self._done.set()

    # -- public -------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self._runtime.layout.num_layers

    def done(self) -> bool:
        """True once the result is known and the store's leases or slots are released."""
        return self._done.is_set()

    def result_now(self) -> TransferResult | None:
        """The batch's result if it is out (what ``wait()`` would return), else None; from
        any thread, without waiting."""
        return self._result if self._published.is_set() else None

    async def wait(self, timeout: float | None = None) -> TransferResult:
        """The batch's result, once every layer is done and the store is updated. ``timeout``:
        seconds (finite, >= 0), or None for ``op_timeout_s``."""
        timeout = check_timeout(timeout)
        timeout = self._runtime.config.op_timeout_s if timeout is None else timeout
        if not await self._abort_on_cancel(event_within(self._result_ready, timeout)):
            raise TransferTimeoutError(f"{type(self).__name__}.wait", timeout)
        assert self._result is not None
        return self._result

    async def aclose(self) -> None:
        """Stop this batch: unfinished chunks count as failed; leases and slots are released."""
        if self._closed:
            return
        self._closed = True
        if not self._done.is_set():
            await self._runtime.shielded(self._stop())

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ev, tev in zip(self._events, self.layer_events, strict=True):
            ev.set()
            tev.set()
        await self._finish()

    async def _abort_on_cancel(self, waiting: Awaitable[T]) -> T:
        """Await one of the caller's waits; a caller cancelled there aborts the batch (shielded,
        as ``aclose``) before its cancellation goes on."""
        try:
            return await waiting
        except asyncio.CancelledError:
            await self.aclose()
            raise

    def _abort(self) -> None:
        for copy in self._submitted:  # copies still queued never start; running ones finish
            copy.cancel()
        if not self._settled:
            self._failed[:] = True
            self._status[self._active] = ChunkStatus.FAILED

    async def __aenter__(self: H) -> H:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the block normally sees a batch that can end on its own (every layer waited
        for, or written) through to its result, within ``op_timeout_s``; any other batch, and
        every batch left by an exception or a cancellation, is aborted."""
        if et is None and not self._closed and self._handed_over():
            with contextlib.suppress(TransferTimeoutError):  # too slow: aborted below
                await self.wait()
        await self.aclose()

    def __repr__(self) -> str:
        done = sum(ev.is_set() for ev in self._events)
        return (
            f"{type(self).__name__}(chunks={self._plan.num_chunks}, copying={self._active.size}, "
            f"layers_done={done}/{self.num_layers}, queued={self._queue.qsize()}, "
            f"done={self.done()})"
        )
