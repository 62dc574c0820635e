"""BatchTransfer: how one request batch ends (the base of both handles).

The batch's driver and completer (``stages.py``) move its layers; when the completer is through,
the batch ends here: the store session is ended (commit or release) and the result published.
Cleanup runs as a task of its own, awaited through ``asyncio.shield``: cancelling the caller,
even twice, cannot cut it short.

A copy that timed out may still be running in its thread: the batch's slots or leases are kept
until it returns, at most ``straggler_grace`` of the engine's config (``runtime.py``), so the
store never reuses memory under it, and its session is ended then (the whole within
``stop_grace``); its result is published at once.

A caller cancelled in one of the handle's waits (``wait_layer``, ``layer_written``, ``wait``)
aborts the batch there, as ``aclose`` does: copies not yet begun never start, and the leases,
pending writes and slots come back before the cancellation goes on, not after ``op_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from kvflow._validate import check_timeout
from kvflow.errors import KVFlowError, TransferTimeoutError
from kvflow.pipeline.batch import BatchPlan
from kvflow.pipeline.runtime import Runtime, stop_grace, straggler_grace
from kvflow.pipeline.stages import BatchStages
from kvflow.pipeline.waits import event_within
from kvflow.results import ChunkStatus, TransferResult
from kvflow.stores.base import ReadSession, WriteSession

__all__ = ["BatchTransfer"]

log = logging.getLogger("kvflow")
H = TypeVar("H", bound="BatchTransfer")
T = TypeVar("T")


class BatchTransfer(BatchStages):
    """The shared machinery of LoadHandle and SaveHandle (see the module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        plan: BatchPlan,
        session: ReadSession | WriteSession | None,
        active: np.ndarray,
        status: np.ndarray,
    ) -> None:
        self._finish_task: asyncio.Task[None] | None = None
        self._result_ready = asyncio.Event()
        self._done = asyncio.Event()
        self._result: TransferResult | None = None
        self._published = threading.Event()
        self._settled = False  # _finish_once has begun: the chunk statuses are final
        self._closed = False
        super().__init__(runtime, plan, session, active, status)  # starts the tasks: last

    # -- to be provided by LoadHandle / SaveHandle --------------------------------------------

    def _release_call(self) -> tuple[Any, tuple[Any, ...]] | None:
        """The store call that ends the session (commit or release) and its arguments."""
        raise NotImplementedError

    def _handed_over(self) -> bool:
        """Every layer is in the batch's hands (waited for, or written): it ends without the
        caller."""
        raise NotImplementedError

    def _mark_settled(self) -> None:
        """From here the chunk statuses are final and no copy starts (SaveHandle: on the
        producer's thread either); copies still running are in ``_futures``."""
        self._settled = True

    # -- the end of the batch -----------------------------------------------------------------

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
        self._mark_settled()
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
        grace = straggler_grace(self._runtime.config)  # then _release: within stop_grace
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
        """True once the result is known and the store's leases or slots are released (or,
        for a copy still running past the grace, held for good: see ``aclose``)."""
        return self._done.is_set()

    def _ended(self) -> bool:
        """``done()``, and none of the batch's copies runs any more: each returned, or was
        cancelled before it began. From any thread."""
        return self._done.is_set() and all(copy.done() for copy in self._submitted)

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

    async def aclose(self, wait: bool = False) -> bool:
        """Stop this batch: unfinished chunks count as failed; leases and slots are released.

        Returns whether the batch has ended: none of its copies runs any more, and its store
        session is over (``done()``). Without ``wait`` that is what it is once stopped (a copy
        past its timeout may still run). With ``wait``, waits until the batch has ended, at
        most ``stop_grace`` of the engine's config from this call (a straggler's grace, then
        the store call that ends the session); False then means a copy still runs past that
        grace: it may yet write the blocks it loads into, or read those it saves from, so they
        must not be reused.
        """
        return await self._close(stop_grace(self._runtime.config) if wait else None)

    async def _close(self, wait_s: float | None) -> bool:
        """``aclose``, waiting at most ``wait_s`` seconds (None: not at all) for the end."""
        deadline = self._loop.time() + (wait_s or 0.0)
        if not self._closed:
            self._closed = True
            if not self._done.is_set():
                await self._runtime.shielded(self._stop())
        if wait_s is not None:
            running = [f for f in self._futures if not f.done()]
            if running:  # the copies first: the batch ends (done) once they have returned
                await asyncio.wait(running, timeout=max(0.0, deadline - self._loop.time()))
            await event_within(self._done, max(0.0, deadline - self._loop.time()))
        return self._ended()

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
