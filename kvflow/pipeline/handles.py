"""Layerwise handles: one request batch moving through the stages, layer by layer.

A handle runs two tasks on the engine's loop, joined by a bounded queue:

    driver:    next layer (load: window slot free; save: layer written)
               -> address generation (NumPy) -> batch_copy submitted to the copy executor
    completer: await each copy in order (with a timeout) -> record failed chunks
               -> set the layer's events -> after the last layer, commit or release in the store

Concurrency contract: a handle belongs to the loop of the engine that made it; its coroutines
must run there. ``layer_events`` are ``threading.Event``s that other threads may wait on. Closing a
handle (``aclose``, or leaving ``async with``) stops its tasks and releases its leases or aborts
its writes in a shielded block; a copy still running in a thread keeps its lease or slot until
it returns, so no slot is reused under a straggling copy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import numpy as np

from kvflow.errors import ClosedError, InvalidArgumentError, TransferTimeoutError
from kvflow.pipeline.addrgen import BatchAddresses, LayerRanges
from kvflow.pipeline.batch import BatchPlan
from kvflow.pipeline.waits import acquire_within, event_within, future_within
from kvflow.results import ChunkStatus, TransferResult
from kvflow.stores.base import Direction, ReadSession, WriteSession

if TYPE_CHECKING:
    from kvflow.pipeline.engine import TransferEngine

__all__ = ["LoadHandle", "SaveHandle"]

log = logging.getLogger("kvflow")
H = TypeVar("H", bound="_Transfer")

_STRAGGLER_GRACE = 10.0  # x copy_timeout_s: how long a late copy may hold its slot or lease


class _Transfer:
    direction: Direction

    def __init__(
        self,
        engine: TransferEngine,
        plan: BatchPlan,
        session: ReadSession | WriteSession | None,
        active: np.ndarray,
        status: np.ndarray,
    ) -> None:
        self._engine = engine
        self._plan = plan
        self._session = session
        self._active = active  # batch chunk indices that are copied
        self._status = status  # per batch chunk, final unless in `active`
        self._failed = np.zeros(active.shape[0], dtype=bool)  # per active chunk
        cfg = engine.config
        self._addresses = (
            BatchAddresses(
                engine.layout,
                plan.chunk_block_ids(active),
                session.addrs[active],
                cfg.chunk_blocks,
                cfg.transfer_limit,
            )
            if session is not None and active.size
            else None
        )
        n = engine.layout.num_layers
        self._events = [asyncio.Event() for _ in range(n)]
        self.layer_events = [threading.Event() for _ in range(n)]
        self._queue: asyncio.Queue[tuple[int, LayerRanges | None, Any]] = asyncio.Queue(
            maxsize=self._window()
        )
        self._futures: list[asyncio.Future[Any]] = []  # every copy submitted
        self._result_ready = asyncio.Event()
        self._done = asyncio.Event()
        self._result: TransferResult | None = None
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

    def _final_status(self) -> None:
        raise NotImplementedError

    async def _release(self) -> None:
        raise NotImplementedError

    # -- the stages ---------------------------------------------------------------------------

    async def _drive(self) -> None:
        engine = self._engine
        for _ in range(engine.layout.num_layers):
            layer, token = await self._next_layer()
            ranges = self._ranges(layer)
            future = None
            if ranges is not None and len(ranges):
                future = asyncio.wrap_future(
                    engine._copier.submit(self._copy, layer, ranges, token)
                )
                self._futures.append(future)
            await self._queue.put((layer, ranges, future))

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
        device = self._engine._device
        if self.direction == Direction.TO_POOL:
            device.wait_ready(token)
        failed = self._engine.store.batch_copy(
            ranges.pool, ranges.local, ranges.sizes, self.direction
        )
        if self.direction == Direction.FROM_POOL:
            device.layer_loaded(layer)
            if len(failed) == 0:  # the fast path: a waiting consumer wakes without a loop hop
                self.layer_events[layer].set()
        return failed

    async def _complete(self) -> None:
        try:
            for _ in range(self._engine.layout.num_layers):
                layer, ranges, future = await self._queue.get()
                if future is not None and ranges is not None:
                    await self._settle(layer, ranges, future)
                self._layer_finished(layer)
                self._events[layer].set()
                self.layer_events[layer].set()
            self._final_status()
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()

    async def _settle(self, layer: int, ranges: LayerRanges, future: asyncio.Future[Any]) -> None:
        stats = self._engine._stats
        timeout = self._engine.config.copy_timeout_s
        failed_chunks: np.ndarray
        try:
            if await future_within(future, timeout):
                failed = np.asarray(future.result(), dtype=np.int64)
                failed_chunks = np.unique(ranges.chunk[failed])
            else:
                stats.timeouts += 1
                self.last_error = TransferTimeoutError(f"copy of layer {layer}", timeout)
                failed_chunks = np.unique(ranges.chunk)
        except Exception as exc:  # a store failure is data: the layer's chunks fail
            log.warning("kvflow: copy of layer %d failed: %r", layer, exc)
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
        """Publish the result, then release store resources once.

        Normally the store is updated first (a saved object is visible when ``wait()`` returns).
        A copy that timed out may still be running in its thread: its slot or lease is kept until
        it returns (bounded by a grace period), so the store never reuses memory under it; then
        the result is published first, so no caller waits for a straggler.
        """
        if self._result is not None:
            return
        self._result = self._plan.result(self._status)
        pending = [f for f in self._futures if not f.done()]
        if pending:
            self._result_ready.set()
            self._engine._background(self._release_after(pending))
            return
        try:
            await self._release()  # a save's objects are visible before its result is
        finally:
            self._engine._handles.discard(self)
            self._result_ready.set()
            self._done.set()

    async def _release_after(self, pending: list[asyncio.Future[Any]]) -> None:
        grace = _STRAGGLER_GRACE * self._engine.config.copy_timeout_s
        _, late = await asyncio.wait(pending, timeout=grace)
        if late:
            log.error(
                "kvflow: %d copies still running after %.0f s; their store resources stay held",
                len(late),
                grace,
            )
            self._engine._handles.discard(self)
            self._done.set()
            return
        try:
            await self._release()
        finally:
            self._engine._handles.discard(self)
            self._done.set()

    # -- public -------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self._engine.layout.num_layers

    def done(self) -> bool:
        """True once the result is known and the store's leases or slots are released."""
        return self._done.is_set()

    async def wait(self, timeout: float | None = None) -> TransferResult:
        """The batch's result, once every layer is done and the store is updated."""
        timeout = self._engine.config.op_timeout_s if timeout is None else timeout
        if not await event_within(self._result_ready, timeout):
            raise TransferTimeoutError(f"{type(self).__name__}.wait", timeout)
        assert self._result is not None
        return self._result

    async def aclose(self) -> None:
        """Stop this batch: unfinished chunks count as failed; leases and slots are released."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if not self._done.is_set():
                for task in self._tasks:
                    task.cancel()
                self._abort()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                for ev, tev in zip(self._events, self.layer_events, strict=True):
                    ev.set()
                    tev.set()
                await self._finish()

    def _abort(self) -> None:
        if self._result is None:
            self._failed[:] = True
            self._status[self._active] = ChunkStatus.FAILED

    async def __aenter__(self: H) -> H:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        done = sum(ev.is_set() for ev in self._events)
        return (
            f"{type(self).__name__}(chunks={self._plan.num_chunks}, copying={self._active.size}, "
            f"layers_done={done}/{self.num_layers}, queued={self._queue.qsize()}, "
            f"done={self.done()})"
        )


class LoadHandle(_Transfer):
    """A batch being loaded layer by layer. ``await wait_layer(i)`` before reading layer i.

    At most ``prefetch_layers`` layers are copied ahead of the consumer: layer j starts only after
    the consumer has waited for layer ``j - prefetch_layers``. ``wait()`` lifts the window.
    """

    direction = Direction.FROM_POOL

    def __init__(self, engine: TransferEngine, *args: Any) -> None:
        self._next = 0
        self._consumed = 0
        self._slots = asyncio.Semaphore(engine.config.prefetch_layers)
        super().__init__(engine, *args)

    def _window(self) -> int:
        return self._engine.config.prefetch_layers

    async def _next_layer(self) -> tuple[int, Any]:
        await self._slots.acquire()
        layer, self._next = self._next, self._next + 1
        return layer, None

    @property
    def consumed(self) -> int:
        """Layers the consumer has passed; layer ``consumed + prefetch_layers - 1`` is the last
        one allowed to start copying."""
        return self._consumed

    def _consume(self, layer: int) -> None:
        """The consumer has passed ``layer``: open the window up to ``layer + prefetch``."""
        for _ in range(self._consumed, layer + 1):
            self._slots.release()
        self._consumed = max(self._consumed, layer + 1)

    def _passed_layer(self, layer: int, waited_s: float, ready: bool) -> None:
        """A synchronous consumer waited ``waited_s`` for ``layer`` (and passed it if ready)."""
        self._engine._record_wait(layer, waited_s)
        if ready:
            self._consume(layer)

    async def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Return when ``layer`` of every chunk is in device memory (or has failed: see
        ``wait()``'s result). Raises TransferTimeoutError after ``timeout`` seconds."""
        layer = self._engine.layout.check_layer(layer)
        if self._closed:
            raise ClosedError("LoadHandle")
        timeout = self._engine.config.op_timeout_s if timeout is None else timeout
        start = time.perf_counter()
        self._consume(layer - 1)
        try:
            ready = await event_within(self._events[layer], timeout)
        finally:
            self._engine._record_wait(layer, time.perf_counter() - start)
        if not ready:
            raise TransferTimeoutError(f"load of layer {layer}", timeout)
        self._consume(layer)
        if self._closed:
            raise ClosedError("LoadHandle")

    async def wait(self, timeout: float | None = None) -> TransferResult:
        self._consume(self.num_layers - 1)
        return await super().wait(timeout)

    def _final_status(self) -> None:
        self._status[self._active] = np.where(self._failed, ChunkStatus.FAILED, ChunkStatus.OK)
        stats = self._engine._stats
        stats.failed_chunks += int(self._failed.sum())
        stats.blocks_loaded += int((~self._failed).sum()) * self._plan.chunk_blocks

    async def _release(self) -> None:
        if isinstance(self._session, ReadSession):
            await self._engine._meta(self._engine.store.close_read, self._session, fail_ok=True)


class SaveHandle(_Transfer):
    """A batch being saved layer by layer. Call ``layer_written(i)`` when layer i is in device
    memory; at most ``save_backlog`` layers wait to be copied before the call itself waits."""

    direction = Direction.TO_POOL

    def __init__(self, engine: TransferEngine, *args: Any) -> None:
        self._written: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._seen: set[int] = set()
        self._copied = 0
        self._backlog = asyncio.Semaphore(engine.config.save_backlog)
        super().__init__(engine, *args)

    def _window(self) -> int:
        return self._engine.config.save_backlog

    async def _next_layer(self) -> tuple[int, Any]:
        return await self._written.get()

    def _layer_finished(self, layer: int) -> None:
        self._copied += 1
        self._backlog.release()

    @property
    def backlog(self) -> int:
        """Layers written but not yet copied (never more than ``save_backlog``)."""
        return len(self._seen) - self._copied

    async def layer_written(self, layer: int, timeout: float | None = None) -> None:
        """Layer ``layer`` of every block in the batch is written: copy it to the pool. Waits
        (at most ``timeout``) while ``save_backlog`` layers are already waiting."""
        await self._layer_written(layer, self._engine._device.layer_written(layer), timeout)

    async def _layer_written(self, layer: int, token: Any, timeout: float | None) -> None:
        layer = self._engine.layout.check_layer(layer)
        if self._closed:
            raise ClosedError("SaveHandle")
        if layer in self._seen:
            raise InvalidArgumentError("layer", layer, "this layer was already written")
        timeout = self._engine.config.op_timeout_s if timeout is None else timeout
        if not await acquire_within(self._backlog, timeout):
            raise TransferTimeoutError(f"save backlog slot for layer {layer}", timeout)
        self._seen.add(layer)
        self._written.put_nowait((layer, token))

    def _final_status(self) -> None:
        self._status[self._active] = np.where(self._failed, ChunkStatus.FAILED, ChunkStatus.OK)
        stats = self._engine._stats
        stats.failed_chunks += int(self._failed.sum())
        stats.blocks_saved += int((~self._failed).sum()) * self._plan.chunk_blocks

    async def _release(self) -> None:
        session = self._session
        if isinstance(session, WriteSession):
            ok = np.zeros(len(session.keys), dtype=bool)
            ok[self._active] = ~self._failed
            await self._engine._meta(self._engine.store.finish_write, session, ok, fail_ok=True)
