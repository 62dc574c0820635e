"""Runtime: what a batch in flight needs from its engine.

A TransferEngine makes one Runtime and hands it to every batch it opens (LoadHandle,
SaveHandle, through BatchTransfer): the layout, store, config and device the bytes move for,
the engine's counters, the copy executor, the thread that makes store metadata calls, the
background tasks and the set of open batches. Batches import this module, never the engine, so
imports run one way: engine -> handles -> transfer -> runtime.

Concurrency contract: a Runtime belongs to its engine's event loop; its methods run there,
except ``late_read`` / ``late_write`` (from any thread). The engine calls ``close`` once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np

from kvflow import trace
from kvflow.config import EngineConfig
from kvflow.devices import DeviceOps
from kvflow.errors import KVFlowError, TransferTimeoutError
from kvflow.layout import KVLayout
from kvflow.pipeline.executor import PinnedExecutor
from kvflow.pipeline.waits import future_within
from kvflow.stats import EngineStats
from kvflow.stores.base import Store

__all__ = ["STRAGGLER_GRACE", "Runtime", "stop_grace", "straggler_grace"]

log = logging.getLogger("kvflow")
T = TypeVar("T")

STRAGGLER_GRACE = 10.0  # x copy_timeout_s: how long a late copy may run on (see stop_grace)


def straggler_grace(config: EngineConfig) -> float:
    """How long a batch waits for a copy that ran past ``copy_timeout_s`` to return
    (``STRAGGLER_GRACE`` times that) before it gives up on it: its slots or leases then stay
    held for good, since the copy may still touch them."""
    return STRAGGLER_GRACE * config.copy_timeout_s


def stop_grace(config: EngineConfig) -> float:
    """How long a stopped batch may take to end: its stragglers' grace (``straggler_grace``),
    then the store call that ends its session (``op_timeout_s``). Callers wait this long for a
    stopped batch to end (``aclose`` or ``close`` with ``wait=True``, the engine's ``close``):
    a batch that has not ended by then has a copy still running."""
    return straggler_grace(config) + config.op_timeout_s


class Batch(Protocol):
    """An open batch, as the runtime sees it (BatchTransfer)."""

    async def aclose(self, wait: bool = False) -> bool: ...


class Runtime:
    """The shared state of one engine's batches (see the module docstring). ``batches``: the
    open ones (a batch removes itself once its store session is released); ``tasks``: the
    background tasks still running (cleanup, releases after straggling copies)."""

    def __init__(
        self, layout: KVLayout, store: Store, config: EngineConfig, device: DeviceOps
    ) -> None:
        self.layout = layout
        self.store = store
        self.config = config
        self.device = device
        self.stats = EngineStats(num_layers=layout.num_layers)
        self.copier = PinnedExecutor(config.copy_threads, config.copy_cpus)
        self.batches: set[Batch] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self._meta_pool = ThreadPoolExecutor(1, thread_name_prefix="kvflow-meta")
        self._here = 0  # copies running on producers' threads (inline saves)
        self._here_lock = threading.Lock()

    def copies_here(self, change: int) -> None:
        """A copy on a producer's thread began (+1) or returned (-1): ``close`` does not
        unregister the caches while one runs."""
        with self._here_lock:
            self._here += change

    def background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` as a task the runtime keeps until it ends (``close`` waits for it)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def shielded(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run cleanup to its end even if the caller is cancelled meanwhile (any number of
        times): it runs as a task of its own; the caller's cancellation is re-raised."""
        await asyncio.shield(self.background(coro))

    def record_wait(self, layer: int, seconds: float) -> None:
        """A consumer waited ``seconds`` for ``layer``."""
        self.stats.layer_wait_s[layer] += seconds
        self.stats.layer_waits[layer] += 1

    async def meta(
        self,
        fn: Callable[..., T],
        *args: Any,
        on_late: Callable[[T], None] | None = None,
    ) -> T:
        """Run a store metadata call on the metadata thread, with ``op_timeout_s`` (or inline,
        for stores whose metadata is in-process: see ``Store.inline_metadata``).

        A call that returns after its timeout hands its result to ``on_late`` (which releases
        what it reserved).
        """
        self.stats.store_metadata_calls += 1
        first = args[0] if args else None  # keys, or a session that carries them
        keys = first if isinstance(first, (tuple, list)) else getattr(first, "keys", ())
        self.stats.keys_touched += len(keys)
        begun = trace.now() if trace.ENABLED else 0
        try:
            if self.store.inline_metadata:
                future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
                try:
                    future.set_result(fn(*args))
                except KVFlowError as exc:
                    future.set_exception(exc)
            else:
                future = asyncio.get_running_loop().run_in_executor(self._meta_pool, fn, *args)
            timeout = self.config.op_timeout_s
            try:
                finished = await future_within(future, timeout)
            except asyncio.CancelledError:
                if on_late is not None:  # what the call reserves is released when it returns
                    future.add_done_callback(lambda f: _late(f, on_late))
                raise
            name = getattr(fn, "__name__", repr(fn))
            if not finished:
                self.stats.timeouts += 1
                if on_late is not None:
                    future.add_done_callback(lambda f: _late(f, on_late))
                raise TransferTimeoutError(f"store.{name}", timeout)
            return future.result()
        finally:
            if begun:
                name = getattr(fn, "__name__", "call").removesuffix("_with_context")
                trace.complete(f"store.{name}", begun, "store", keys=len(keys))

    def late_read(self, session: Any) -> None:
        """Release a read session nobody took (its open returned too late, or its batch could
        not be built), on the metadata thread."""
        self._meta_pool.submit(_quiet, self.store.close_read, session)

    def late_write(self, session: Any) -> None:
        """Abort a write session nobody took, on the metadata thread."""
        ok = np.zeros(len(session.keys), dtype=bool)
        self._meta_pool.submit(_quiet, self.store.finish_write, session, ok)

    async def close(self) -> None:
        """Abort the open batches, give straggling releases their grace, unregister the KV
        caches from the store (only when no copy still runs), stop the threads."""
        for batch in list(self.batches):
            await batch.aclose()
        others = self.tasks - {asyncio.current_task()}
        if others:  # releases waiting for straggling copies, bounded by their grace
            await asyncio.wait(others, timeout=stop_grace(self.config))
        stuck = self.copier.in_flight > 0 or self._here > 0 or any(not t.done() for t in others)
        if stuck:
            log.error("kvflow: closing with copies still running; their threads are left")
        else:  # nothing copies any more: the store may let go of the caches' memory
            await self._unregister()
        self.copier.shutdown(wait=False)
        self._meta_pool.shutdown(wait=False)

    async def _unregister(self) -> None:
        call = functools.partial(self.store.unregister, self.layout.regions())
        try:
            future = asyncio.get_running_loop().run_in_executor(self._meta_pool, call)
            await asyncio.wait_for(future, self.config.op_timeout_s)
        except (KVFlowError, TimeoutError) as exc:
            log.warning("kvflow: the store did not unregister the KV caches: %r", exc)


def _late(future: asyncio.Future[Any], on_late: Callable[[Any], None]) -> None:
    if not future.cancelled() and future.exception() is None:
        on_late(future.result())


def _quiet(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except KVFlowError as exc:
        log.warning("kvflow: releasing a late store session failed: %s", exc)
