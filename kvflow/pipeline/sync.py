"""SyncTransferEngine: the engine for callers that are not async (an inference worker's forward).

The engine's event loop runs in a daemon thread of its own ("kvflow-loop"). Every method here is
thread-safe and blocking, with a timeout (default ``op_timeout_s``); a call that runs past it
raises TransferTimeoutError, and a timeout that is negative, NaN or infinite raises
InvalidArgumentError before anything starts. ``SyncLoadHandle.wait_layer`` waits on a
thread-safe event without a trip through the loop, so a per-layer wait costs microseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

from kvflow import trace
from kvflow._validate import check_timeout
from kvflow.config import EngineConfig
from kvflow.cpus import pin_current_thread
from kvflow.devices import DeviceOps
from kvflow.errors import ClosedError, KVFlowError, TransferTimeoutError
from kvflow.keys import KeySpace
from kvflow.layout import KVLayout
from kvflow.pipeline.batch import BlockRequest
from kvflow.pipeline.engine import TransferEngine
from kvflow.pipeline.handles import LoadHandle, SaveHandle
from kvflow.pipeline.runtime import stop_grace
from kvflow.pipeline.transfer import BatchTransfer
from kvflow.results import TransferResult
from kvflow.stats import EngineStats
from kvflow.stores.base import Store

__all__ = ["SyncLoadHandle", "SyncSaveHandle", "SyncTransferEngine"]

T = TypeVar("T")
H = TypeVar("H", bound=BatchTransfer)
Self_ = TypeVar("Self_", bound="_Opening[Any]")


class SyncTransferEngine:
    """A TransferEngine driven from any thread; its loop lives in a thread it owns.

    With ``copy_cpus`` configured, the loop thread pins itself there too: the engine's
    bookkeeping then never takes time from the cores that compute.
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
        self.engine = TransferEngine(layout, store, config, keyspace=keyspace, device=device)
        config = self.engine.config
        self._timeout = config.op_timeout_s
        here = self.engine.device.synchronous  # EngineConfig.inline_saves, .deferred_saves
        self._inline_saves = config.inline_saves and here and store.saves_in_memory
        self._deferred_saves = config.deferred_saves and here and not self._inline_saves
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, args=(config.copy_cpus,), name="kvflow-loop", daemon=True
        )
        self._thread.start()

    def _run(self, cpus: tuple[int, ...]) -> None:
        pin_current_thread(cpus)
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(
        self,
        coro: Coroutine[Any, Any, T],
        timeout: float | None,
        what: str,
        on_late: Callable[[T], Any] | None = None,
    ) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout``. A result that arrives after
        the timeout is handed to ``on_late`` (which closes what it opened)."""
        if self._closed:
            coro.close()
            raise ClosedError("SyncTransferEngine")
        limit = self._timeout if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TransferTimeoutError (a TimeoutError too)
                return future.result()
            if on_late is not None:
                future.add_done_callback(lambda f: _hand_over(f, on_late, self._loop))
            future.cancel()
            raise TransferTimeoutError(what, limit) from None

    @property
    def layout(self) -> KVLayout:
        return self.engine.layout

    def lookup(self, token_ids: Any, timeout: float | None = None) -> int:
        timeout = check_timeout(timeout)
        return self._call(self.engine.lookup(token_ids), timeout, "lookup")

    def load(self, token_ids: Any, block_ids: Any, timeout: float | None = None) -> TransferResult:
        timeout = check_timeout(timeout)
        return self._call(self.engine.load(token_ids, block_ids), timeout, "load")

    def save(self, token_ids: Any, block_ids: Any, timeout: float | None = None) -> TransferResult:
        timeout = check_timeout(timeout)
        return self._call(self.engine.save(token_ids, block_ids), timeout, "save")

    def start_load(self, requests: Sequence[BlockRequest | tuple[Any, Any]]) -> SyncLoadHandle:
        """Start loading a batch; returns without waiting for the store. The requests are
        checked here (bad ones raise at once); the pool's session is opened on the engine's
        loop while the caller goes on, and the first ``wait_layer`` waits for it (within its
        own timeout): a forward's first layers overlap the store's round trip."""
        if self._closed:
            raise ClosedError("SyncTransferEngine")
        plan = self.engine.plan(requests, load=True)
        ready = self.engine.device.load_started()  # on the caller's thread (its stream)
        opening = asyncio.run_coroutine_threadsafe(self.engine.open_load(plan, ready), self._loop)
        return SyncLoadHandle(self, opening)

    def start_save(
        self, requests: Sequence[BlockRequest | tuple[Any, Any]], timeout: float | None = None
    ) -> SyncSaveHandle:
        """Start saving a batch; returns without waiting for the store, like ``start_load``:
        the requests are checked here, the pool's session opens on the loop while the caller
        computes, and the first ``layer_written`` waits for it (at most ``timeout``, default
        that call's own timeout)."""
        timeout = check_timeout(timeout)
        if self._closed:
            raise ClosedError("SyncTransferEngine")
        plan = self.engine.plan(requests, load=False)
        opening = asyncio.run_coroutine_threadsafe(self.engine.open_save(plan), self._loop)
        return SyncSaveHandle(self, opening, timeout)

    def stats(self) -> EngineStats:
        stats: EngineStats = self._call(_value(self.engine.stats), None, "stats")
        return stats

    def close(self) -> None:
        """Close the engine (aborting open batches) and stop the loop thread. Thread-safe;
        waits as long as the engine's own shutdown may take (see ``TransferEngine.close``)."""
        with self._close_lock:
            if self._closed:
                return
            cfg = self.engine.config
            limit = stop_grace(cfg) + cfg.op_timeout_s  # each open batch stopped, then ended
            try:
                self._call(self.engine.close(), limit, "close")
            finally:
                self._closed = True
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=self._timeout)
                if not self._thread.is_alive():
                    self._loop.close()

    def __enter__(self) -> SyncTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sync{self.engine!r}"


async def _value(fn: Any) -> Any:
    return fn()


def _hand_over(
    future: concurrent.futures.Future[Any], on_late: Callable[[Any], Any], loop: Any
) -> None:
    """A call finished after its caller gave up: pass its result to ``on_late`` on the loop."""
    if future.cancelled() or future.exception() is not None:
        return
    result = on_late(future.result())
    if asyncio.iscoroutine(result):
        asyncio.run_coroutine_threadsafe(result, loop)


class _Opening(Generic[H]):
    """Blocking view of a handle whose store session may still be opening (see
    ``SyncTransferEngine.start_load``). An open that fails (the store down, the engine closed)
    raises from the first call that needs the handle."""

    _kind: type[H]

    def __init__(
        self,
        owner: SyncTransferEngine,
        opening: concurrent.futures.Future[H],
        open_timeout: float | None = None,
    ) -> None:
        self._owner = owner
        self._opening = opening
        self._open_timeout = open_timeout  # bounds the wait for the session, if given
        self._handle: H | None = None

    @property
    def handle(self) -> H:
        """The engine's handle, once open (waits at most ``op_timeout_s``)."""
        return self._opened(None)

    def _opened(self, timeout: float | None) -> H:
        if self._handle is None:
            limit = self._owner._timeout if timeout is None else timeout
            if self._open_timeout is not None:
                limit = self._open_timeout
            name = self._kind.__name__
            try:
                self._handle = self._opening.result(limit)
            except concurrent.futures.TimeoutError:
                raise TransferTimeoutError(f"{name}'s store session", limit) from None
            except concurrent.futures.CancelledError:
                raise ClosedError(name) from None
        return self._handle

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until the batch's result is known (at most ``timeout`` seconds). A result
        already out is returned at once: the end of a forward that overlapped the whole
        transfer makes no round trip through the loop.

        The wait is on the caller's thread, never through the loop: a busy loop cannot cut it
        short, and one that times out leaves the batch going (``close`` or leaving ``with``
        stops it)."""
        timeout = check_timeout(timeout)
        h = self._opened(timeout)
        result = h.result_now()
        if result is None:
            limit = self._owner._timeout if timeout is None else timeout
            self._waiting(h)
            if not h._published.wait(limit):
                raise TransferTimeoutError(f"{type(h).__name__}.wait", limit)
            result = h.result_now()
            assert result is not None
        return result

    def _waiting(self, h: H) -> None:
        """The caller waits for the whole batch (a load lifts its prefetch window)."""

    def _handed_over(self) -> bool:
        """Every layer is in the batch's hands, as this caller has seen it."""
        raise NotImplementedError

    def close(self, wait: bool = False) -> bool:
        """Stop the batch; its leases and slots are released. Returns whether the batch has
        ended: none of its copies runs any more and its store session is over (``done()``);
        an open that failed has nothing to end (True).

        Without ``wait``, does not wait for a session still opening (that one is released as
        soon as it opens: ``done()`` says when) nor for a copy past its timeout, so False may
        mean "not yet". With ``wait``, blocks until the batch has ended, the session's opening
        included, at most ``stop_grace`` of the engine's config in all (``STRAGGLER_GRACE``
        times ``copy_timeout_s``, plus ``op_timeout_s``); False then means a copy still runs
        past that grace and may yet write the blocks it loads into (or read those it saves
        from): they must not be handed to anyone else. The wait is the caller's; the engine's
        loop goes on meanwhile."""
        grace = stop_grace(self._owner.engine.config)
        start = time.monotonic()
        if wait and self._handle is None:  # its open is bounded by op_timeout_s
            concurrent.futures.wait((self._opening,), timeout=grace)
        if self._handle is None and not self._opening.done():  # closed when it opens
            kind = self._kind
            self._opening.add_done_callback(lambda f: _hand_over(f, kind.aclose, self._owner._loop))
            return False
        try:
            h = self._opened(None)
        except KVFlowError:  # the open failed: nothing to close, nothing was copied
            return True
        self._owner._call(h.aclose(), None, "close")  # stopped, whatever the wait below does
        if not wait:
            return h._ended()
        left = max(0.0, grace - (time.monotonic() - start))
        try:  # the batch is stopped already: a wait cut short cancels only the waiting
            ended: bool = self._owner._call(h._close(left), left, "close")
        except TransferTimeoutError:  # the loop did not answer within the grace
            return h._ended()
        return ended

    def done(self) -> bool:
        if self._handle is None:
            if not self._opening.done():
                return False
            if self._opening.cancelled() or self._opening.exception() is not None:
                return True
            self._handle = self._opening.result()
        return self._handle.done()

    def __enter__(self: Self_) -> Self_:
        return self

    def __exit__(self, et: type[BaseException] | None, *exc: object) -> None:
        """As leaving ``async with`` a handle: a normal exit sees a batch that can end on its
        own (every layer waited for, or written) through to its result, within
        ``op_timeout_s``; any other batch, and every batch left by an exception, is stopped."""
        if et is None and self._handle is not None and self._handed_over():
            with contextlib.suppress(TransferTimeoutError):  # too slow: stopped below
                self.wait()
        self.close()


class SyncLoadHandle(_Opening[LoadHandle]):
    """Blocking view of a LoadHandle (see ``_Opening``). One loop hop per ``wait_layer``, sent
    without waiting."""

    _kind = LoadHandle

    def __init__(
        self, owner: SyncTransferEngine, opening: concurrent.futures.Future[LoadHandle]
    ) -> None:
        super().__init__(owner, opening)
        self._passed = -1  # the last layer this caller has waited for

    def _waiting(self, h: LoadHandle) -> None:
        self._owner._loop.call_soon_threadsafe(h._consume, h.num_layers - 1)

    def _handed_over(self) -> bool:
        return self._handle is not None and self._passed >= self._handle.num_layers - 1

    def load_all(self) -> None:
        """Let every layer load with no per-layer wait (the prefetch window lifted, once the
        store session is open); returns at once. For a load nobody computes beside, read later
        through ``done()`` and ``wait()``: vLLM's asynchronous loads."""
        if self._handle is not None:
            self._waiting(self._handle)
            return

        def lift(opening: concurrent.futures.Future[LoadHandle]) -> None:
            if not opening.cancelled() and opening.exception() is None:
                self._waiting(opening.result())

        self._opening.add_done_callback(lift)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer``'s copy is done (on a CUDA GPU: issued); moves the prefetch
        window forward. On an accelerator the caller's current stream is also made to wait for
        the copy's event (``DeviceOps.order_after``), so its later kernels read the loaded
        layer."""
        timeout = check_timeout(timeout)
        limit = self._owner._timeout if timeout is None else timeout
        h = self._opened(limit)
        layer = self._owner.layout.check_layer(layer)
        loop = self._owner._loop
        if layer > self._passed + 1:  # layers skipped: they must not hold the window shut
            loop.call_soon_threadsafe(h._consume, layer - 1)
        start = time.perf_counter()
        if trace.ENABLED:
            begun = trace.now()
        ready = h.layer_events[layer].wait(limit)
        if trace.ENABLED:
            trace.complete("wait_layer", begun, "wait", layer=layer, ready=ready)
        loop.call_soon_threadsafe(h._passed_layer, layer, time.perf_counter() - start, ready)
        if not ready:
            raise TransferTimeoutError(f"load of layer {layer}", limit)
        self._passed = max(self._passed, layer)
        if h._closed:
            raise ClosedError("LoadHandle")
        self._owner.engine.device.order_after(h.loaded_tokens[layer])  # the caller's stream


class SyncSaveHandle(_Opening[SaveHandle]):
    """Blocking view of a SaveHandle (see ``_Opening``)."""

    _kind = SaveHandle

    def _handed_over(self) -> bool:
        return self._handle is not None and self._handle._handed_over()

    def layer_written(self, layer: int, timeout: float | None = None) -> None:
        """Layer ``layer`` is written: handed to the loop at once while the save backlog has
        room, or after waiting (at most ``timeout``) for it; the first call also waits for the
        store session. Inline saves copy it here instead, deferred saves keep it for the last
        call to hand over with the others (``EngineConfig.inline_saves``, ``.deferred_saves``)."""
        timeout = check_timeout(timeout)
        if trace.ENABLED:
            begun = trace.now()
        h = self._opened(timeout)
        layer, limit = h._claim(layer, timeout)
        owner = self._owner
        token = owner.engine.device.layer_written(layer)  # the caller's thread, its stream
        if owner._inline_saves:
            h._copy_written(layer, token)
        elif owner._deferred_saves:
            h._defer_written(layer, token)
        else:
            h._hand_written(layer, token, limit)
        if trace.ENABLED:
            trace.complete("layer_written", begun, "wait", layer=layer)
        if h._closed:
            raise ClosedError("SaveHandle")
