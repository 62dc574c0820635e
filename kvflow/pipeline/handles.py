"""LoadHandle and SaveHandle: a request batch loaded or saved layer by layer.

Concurrency contract: a handle belongs to the loop of the engine that made it; its coroutines
must run there. ``layer_events`` are ``threading.Event``s that other threads may wait on. Use it
as ``async with await engine.start_load(...) as load:`` (``start_save`` alike). Closing a handle
(``aclose``, or leaving ``async with`` by an exception, a cancellation, or early) stops its tasks
and releases its leases or aborts its writes; leaving the block normally after every layer was
waited for (or written) waits for the result instead, so a save is visible after the block.
Cancelling a task in ``wait_layer``, ``layer_written`` or ``wait`` closes the handle the same way,
``async with`` or not; a ``timeout`` that runs out raises TransferTimeoutError and leaves the
batch going. A copy still running in a thread keeps its lease or slot until it returns, so no
slot is reused under a straggling copy. For a load, that also means: blocks whose copy timed
out may still be written until ``done()``; do not hand them to another request before then.
``aclose(wait=True)`` stops the batch and waits for that (at most ``stop_grace``), and says
whether it came.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

import numpy as np

from kvflow import trace
from kvflow._validate import check_timeout
from kvflow.errors import ClosedError, InvalidArgumentError, KVFlowError, TransferTimeoutError
from kvflow.pipeline.runtime import Runtime
from kvflow.pipeline.stages import Copied
from kvflow.pipeline.transfer import BatchTransfer
from kvflow.pipeline.waits import acquire_within, event_within, get_within
from kvflow.results import TransferResult
from kvflow.stores.base import Direction, ReadSession, WriteSession

__all__ = ["LoadHandle", "SaveHandle"]

log = logging.getLogger("kvflow")


class LoadHandle(BatchTransfer):
    """A batch being loaded layer by layer. ``await wait_layer(i)`` before reading layer i.

    At most ``prefetch_layers`` layers are copied ahead of the consumer: layer j starts only after
    the consumer has waited for layer ``j - prefetch_layers``. ``wait()`` lifts the window.
    """

    direction = Direction.FROM_POOL
    _blocks_stat = "blocks_loaded"

    def __init__(self, runtime: Runtime, *args: Any) -> None:
        self._next = 0
        self._consumed = 0
        self.ready: Any = None  # DeviceOps.load_started's token: every copy waits for it
        self._slots = asyncio.Semaphore(runtime.config.prefetch_layers)
        super().__init__(runtime, *args)

    def _window(self) -> int:
        return self._runtime.config.prefetch_layers

    async def _next_layer(self) -> tuple[int, Any]:
        limit = self._runtime.config.op_timeout_s
        if not await acquire_within(self._slots, limit):
            raise TransferTimeoutError(f"the consumer passing layer {self._next - 1}", limit)
        layer, self._next = self._next, self._next + 1
        return layer, self.ready

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
        self._runtime.record_wait(layer, waited_s)
        if ready:
            self._consume(layer)

    async def wait_layer(self, layer: int, timeout: float | None = None) -> Any:
        """Return when ``layer`` of every chunk is in device memory (or has failed: see
        ``wait()``'s result); on a CUDA GPU, when its copies are issued: the returned token is
        the event to order the consumer's stream after (``DeviceOps.order_after``). Raises
        TransferTimeoutError after ``timeout`` seconds. None on CPU."""
        layer = self._runtime.layout.check_layer(layer)
        if self._closed:
            raise ClosedError("LoadHandle")
        timeout = check_timeout(timeout)
        timeout = self._runtime.config.op_timeout_s if timeout is None else timeout
        start = time.perf_counter()
        begun = trace.now() if trace.ENABLED else 0
        self._consume(layer - 1)
        try:
            ready = await self._abort_on_cancel(event_within(self._events[layer], timeout))
        finally:
            self._runtime.record_wait(layer, time.perf_counter() - start)
            if trace.ENABLED:
                trace.complete("wait_layer", begun, "wait", layer=layer)
        if not ready:
            raise TransferTimeoutError(f"load of layer {layer}", timeout)
        self._consume(layer)
        if self._closed:
            raise ClosedError("LoadHandle")
        return self.loaded_tokens[layer]

    async def wait(self, timeout: float | None = None) -> TransferResult:
        timeout = check_timeout(timeout)  # refused before the window opens
        self._consume(self.num_layers - 1)
        return await super().wait(timeout)

    def _handed_over(self) -> bool:
        return self._consumed >= self.num_layers

    def _release_call(self) -> tuple[Any, tuple[Any, ...]] | None:
        if isinstance(self._session, ReadSession):
            return self._runtime.store.close_read, (self._session,)
        return None


class _Backlog:
    """Slots for layers written but not yet copied: taken from any thread (blocking or async),
    given back on the loop by the completer."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._cond = threading.Condition()
        self._freed = asyncio.Event()

    @property
    def free(self) -> int:
        return self._free

    def try_take(self) -> bool:
        with self._cond:
            if self._free > 0:
                self._free -= 1
                return True
            return False

    def take_blocking(self, timeout: float) -> bool:
        """From a producer thread: wait (at most ``timeout``) for a slot."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free > 0, timeout):
                return False
            self._free -= 1
            return True

    async def take(self, timeout: float) -> bool:
        """On the loop: wait (at most ``timeout``) for a slot."""
        deadline = time.monotonic() + timeout
        while not self.try_take():
            self._freed.clear()
            if self.try_take():  # given back between the check and the clear
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not await event_within(self._freed, left):
                return False
        return True

    def give(self, n: int = 1) -> None:
        """On the loop: a layer was copied (or the batch ended: wake everyone)."""
        with self._cond:
            self._free += n
            self._cond.notify_all()
        self._freed.set()


class SaveHandle(BatchTransfer):
    """A batch being saved layer by layer. Call ``layer_written(i)`` when layer i is in device
    memory; at most ``save_backlog`` layers wait to be copied before the call itself waits
    (``SyncTransferEngine``'s inline and deferred saves take no slot: see ``_copy_written``,
    ``_defer_written``)."""

    direction = Direction.TO_POOL
    _blocks_stat = "blocks_saved"

    def __init__(self, runtime: Runtime, *args: Any) -> None:
        self._written: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._seen: set[int] = set()
        self._copied = 0
        self._backlog = _Backlog(runtime.config.save_backlog)
        self._claims = threading.Lock()  # _seen is claimed from producer threads too
        self._started_here = 0  # copies begun on a producer's thread (under _claims)
        self._running_here = 0  # of those, not yet returned
        self._here_done: concurrent.futures.Future[None] | None = None  # see _mark_settled
        self._copied_here: list[tuple[int, Copied]] = []  # not yet handed to the driver
        self._deferred: list[tuple[int, Any]] = []  # deferred saves' layers, not yet handed
        self._slotless = False  # inline or deferred: no layer takes a backlog slot
        self._written_at = time.monotonic()  # a producer's last copy (see _next_layer)
        super().__init__(runtime, *args)

    def _before_start(self) -> None:
        if self._addresses is None:
            return
        n = self._runtime.layout.num_layers
        self._built = [self._addresses.layer(i) for i in range(n)]  # not in a forward
        try:  # checked once here, not at every layer's copy (Store.prepare_writes)
            self._prepared = self._runtime.store.prepare_writes(
                [(r.pool, r.local, r.sizes) for r in self._built]
            )
        except KVFlowError as exc:  # each layer's batch_copy then fails as it would
            log.debug("kvflow: prepare_writes: %s; copying layer by layer", exc)

    def _window(self) -> int:
        return self._runtime.config.save_backlog

    async def _next_layer(self) -> tuple[int, Any]:
        """The next layer written; fails once the producer has been silent ``op_timeout_s``
        (with inline or deferred saves its layers come after the last one, and each layer it
        copies or keeps is word from it)."""
        limit = wait = self._runtime.config.op_timeout_s
        while (item := await get_within(self._written, wait)) is None:
            wait = limit - (time.monotonic() - self._written_at)
            if wait <= 0:
                raise TransferTimeoutError(f"layer_written after {len(self._seen)} layers", limit)
        return item

    def _layer_finished(self, layer: int) -> None:
        self._copied += 1
        if not self._slotless:  # an inline or deferred save's layers never took a slot
            self._backlog.give()

    def _abort(self) -> None:
        super()._abort()
        self._backlog.give(self.num_layers)  # producers waiting for a slot wake and see closed

    @property
    def backlog(self) -> int:
        """Layers written but not yet copied: never more than ``save_backlog`` through the copy
        thread layer by layer; inline or deferred saves (which take no slot) count them."""
        if self._slotless:  # copied on the producer's thread (inline), or by the driver
            done = max(self._copied, self._started_here - self._running_here)
            return max(0, len(self._seen) - done)
        return max(0, self._runtime.config.save_backlog - self._backlog.free)

    @property
    def copied(self) -> int:
        """Layers whose copy has finished."""
        return self._copied

    async def layer_written(self, layer: int, timeout: float | None = None) -> None:
        """Layer ``layer`` of every block in the batch is written: copy it to the pool. Waits
        (at most ``timeout``) while ``save_backlog`` layers are already waiting."""
        await self._layer_written(layer, self._runtime.device.layer_written(layer), timeout)

    async def _layer_written(self, layer: int, token: Any, timeout: float | None) -> None:
        layer, limit = self._claim(layer, timeout)
        if not await self._abort_on_cancel(self._backlog.take(limit)):
            self._unclaim(layer, limit)
        if self._closed:
            raise ClosedError("SaveHandle")
        self._queue_layer(layer, token)

    def _claim(self, layer: int, timeout: float | None) -> tuple[int, float]:
        """Check and claim ``layer`` before waiting, so a second call for it is refused."""
        timeout = check_timeout(timeout)
        layer = self._runtime.layout.check_layer(layer)
        with self._claims:
            if self._closed:
                raise ClosedError("SaveHandle")
            if layer in self._seen:
                raise InvalidArgumentError("layer", layer, "this layer was already written")
            self._seen.add(layer)
        return layer, self._runtime.config.op_timeout_s if timeout is None else timeout

    def _unclaim(self, layer: int, timeout: float) -> None:
        with self._claims:
            self._seen.discard(layer)
        raise TransferTimeoutError(f"save backlog slot for layer {layer}", timeout)

    def _queue_layer(self, layer: int, token: Any) -> None:
        """On the loop: hand a claimed layer, with its slot, to the driver (a closed batch has
        no driver any more: the layer is dropped)."""
        if not self._closed:
            self._written.put_nowait((layer, token))

    def _copy_written(self, layer: int, token: Any) -> None:
        """On the producer's thread, for a claimed layer (``EngineConfig.inline_saves``): copy
        it now, and once every layer is copied hand them to the driver in one loop hop: a loop
        and a copy thread waking at every layer take the GIL from the producer's forward at
        every one of its ops. No backlog slot is taken (nothing waits to be copied), and
        ``copy_timeout_s`` does not apply: the copy is a memmove (``Store.saves_in_memory``)
        the caller waits for. A batch that settles while such a copy runs waits for it as for
        a copy thread's (``_mark_settled``): it keeps its slots until the copy returns."""
        with self._claims:
            if self._closed or self._settled:
                raise ClosedError("SaveHandle")
            self._started_here += 1
            self._running_here += 1
            self._slotless = True
        self._runtime.copies_here(+1)
        try:
            copied = Copied(self._ranges(layer))
            if copied.ranges is not None and len(copied.ranges):
                try:
                    copied = Copied(copied.ranges, self._copy(layer, copied.ranges, token))
                except Exception as exc:  # a store failure is data: settled as a copy thread's
                    copied = Copied(copied.ranges, error=exc)
        finally:
            self._runtime.copies_here(-1)
            with self._claims:
                self._running_here -= 1
                ended = self._here_done if self._running_here == 0 else None
            if ended is not None:
                ended.set_result(None)
        self._written_at = time.monotonic()
        with self._claims:
            self._copied_here.append((layer, copied))
            if self._running_here or self._started_here < self.num_layers or self._settled:
                return  # the last copy to end hands over; a settled batch takes none
            layers, self._copied_here = self._copied_here, []
        try:
            self._loop.call_soon_threadsafe(self._queue_copied, layers)
        except RuntimeError:  # the engine's loop is closed
            raise ClosedError("SaveHandle") from None

    def _hand_written(self, layer: int, token: Any, limit: float) -> None:
        """On the producer's thread, for a claimed layer: hand it to the driver once a backlog
        slot is free (at most ``limit`` seconds; a closed batch's loop drops it)."""
        if not self._backlog.take_blocking(limit):
            self._unclaim(layer, limit)
        if self._closed:  # _abort woke it: the slots are all given back
            raise ClosedError("SaveHandle")
        try:
            self._loop.call_soon_threadsafe(self._queue_layer, layer, token)
        except RuntimeError:  # the engine's loop is closed
            raise ClosedError("SaveHandle") from None

    def _defer_written(self, layer: int, token: Any) -> None:
        """On the producer's thread, for a claimed layer (``EngineConfig.deferred_saves``):
        keep it; the last one hands every layer to the driver in one loop hop, so that neither
        the loop nor a copy thread wakes beside the producer's forward (see ``_copy_written``).
        No backlog slot is taken: nothing is copied before the last layer."""
        with self._claims:
            if self._closed or self._settled:
                raise ClosedError("SaveHandle")
            self._slotless = True
            self._written_at = time.monotonic()
            self._deferred.append((layer, token))
            if len(self._deferred) < self.num_layers:
                return
            layers, self._deferred = self._deferred, []
        try:
            self._loop.call_soon_threadsafe(self._queue_deferred, layers)
        except RuntimeError:  # the engine's loop is closed
            raise ClosedError("SaveHandle") from None

    def _queue_deferred(self, layers: list[tuple[int, Any]]) -> None:
        for layer, token in layers:
            self._queue_layer(layer, token)

    def _queue_copied(self, layers: list[tuple[int, Copied]]) -> None:
        for layer, copied in layers:
            self._queue_layer(layer, copied)

    def _mark_settled(self) -> None:
        """No copy starts on a producer's thread from here; those still running are waited
        for as the copy threads' are (in ``_futures``, and ``_submitted`` for ``_ended``)."""
        with self._claims:
            super()._mark_settled()
            self._deferred = []  # never handed over now
            if self._running_here:
                self._here_done = concurrent.futures.Future()
                self._here_done.set_running_or_notify_cancel()
                self._submitted.append(self._here_done)
            running = self._here_done
        if running is not None:
            self._futures.append(asyncio.wrap_future(running))

    def _handed_over(self) -> bool:
        return len(self._seen) == self.num_layers

    def _release_call(self) -> tuple[Any, tuple[Any, ...]] | None:
        session = self._session
        if not isinstance(session, WriteSession):
            return None
        ok = np.zeros(len(session.keys), dtype=bool)
        ok[self._active] = ~self._failed
        return self._runtime.store.finish_write, (session, ok)
