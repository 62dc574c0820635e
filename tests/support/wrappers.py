"""A store wrapper for engine tests: a real LocalStore, counted, with a hook before each copy.

No fake pool: the hook changes only the copies a test chooses (stall, fail, raise). Beside it,
what the save tests share: a hook that records which thread copied each save's layer
(``SaveCopies``), the engine's slots all given back, and saved blocks loaded back bit-exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import kvflow
from kvflow.abc import Direction, Store
from kvflow.pipeline.handles import SaveHandle
from kvflow.testing import InstrumentedStore
from tests.support.caches import make_caches
from tests.support.pools import dispose, make_store
from tests.support.waits import wait_until


class WrappedStore(InstrumentedStore):
    """``before_copy(direction, pool, local, sizes)`` runs before each copy, on the thread that
    copies; returning an array of range indices reports those ranges failed instead of copying.

    The hook may stall, so saves are not copied on the producer's thread
    (``saves_in_memory`` False, whatever ``inner``'s) unless ``inline`` says so."""

    def __init__(self, inner: Store, *, inline: bool = False) -> None:
        super().__init__(inner, record_copies=True)
        self.saves_in_memory = inline and inner.saves_in_memory
        self.before_copy: Callable[[Direction, np.ndarray, np.ndarray, np.ndarray], Any] = (
            lambda *a: None
        )

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        override = self.before_copy(direction, pool_addrs, local_addrs, sizes)
        if override is not None:
            self._count("batch_copy")
            return np.asarray(override, dtype=np.int64)
        return super().batch_copy(pool_addrs, local_addrs, sizes, direction)


Parts = tuple[list[torch.Tensor], kvflow.KVLayout, WrappedStore]


@contextmanager
def wrapped_parts(
    store_name: str, layers: int, block_size: int, *, inline: bool = False
) -> Iterator[Parts]:
    """Caches of ``layers`` layers, their layout, and a ``WrappedStore`` (``inline`` as its
    own) over a 16 MiB store of that name, disposed of at the end."""
    caches = make_caches(layers)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=block_size)
    store = WrappedStore(make_store(store_name, "16MiB"), inline=inline)
    try:
        yield caches, layout, store
    finally:
        dispose(store)


class SaveCopies:
    """Records the thread of every save's copy; ``fail``: per save copy (from 0), the range
    indices to report failed, or an exception to raise."""

    def __init__(self, store: WrappedStore, fail: dict[int, Any] | None = None) -> None:
        self.seen: list[int] = []
        self.fail = fail or {}
        store.before_copy = self

    def __call__(self, direction: Direction, *args: Any) -> Any:
        if direction != Direction.TO_POOL:
            return None
        nth = len(self.seen)
        self.seen.append(threading.get_ident())
        outcome = self.fail.get(nth)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def sync_released(e: kvflow.SyncTransferEngine, store: WrappedStore) -> None:
    """The engine holds nothing in the pool any more (polled: a batch ends on the loop)."""

    def idle() -> bool:
        usage = store.usage()
        assert usage is not None
        batches = e.engine._runtime.batches
        return not batches and (usage.leases, usage.pending_writes, usage.open_sessions) == (0,) * 3

    wait_until(idle, 60.0, "the engine's batches to end and give back their slots")


def loads_back(e: kvflow.SyncTransferEngine, caches: list[torch.Tensor], tokens: Any) -> None:
    for c in caches:
        c[10:14].zero_()
    assert e.load(tokens, np.arange(10, 14)).ok
    for c in caches:
        assert torch.equal(c[10:14].view(torch.uint8), c[0:4].view(torch.uint8))


def save_by_layers(
    e: kvflow.SyncTransferEngine, tokens: Any, blocks: Any, layers: int
) -> kvflow.TransferResult:
    """Save as an inference worker does, through ``start_save`` and ``layer_written`` (the
    path inline and deferred saves take; ``SyncTransferEngine.save`` is the async engine's)."""
    with e.start_save([(tokens, blocks)]) as save:
        for layer in range(layers):
            save.layer_written(layer, timeout=60)
        return save.wait(timeout=60)


def hand_overs(monkeypatch: Any, method: str) -> list[int]:
    """How many layers each call of ``SaveHandle.<method>`` (a hand-over of a producer's layers
    to the engine's loop: ``_queue_copied``, ``_queue_deferred``) carried, in order."""
    carried: list[int] = []
    queue = getattr(SaveHandle, method)

    def counted(self: SaveHandle, layers: Any) -> None:
        carried.append(len(layers))
        queue(self, layers)

    monkeypatch.setattr(SaveHandle, method, counted)
    return carried


def random_tokens(count: int, seed: int = 0) -> np.ndarray:
    """``count`` token ids no other seed's prompt shares."""
    return np.random.default_rng(seed).integers(0, 30_000, count)


class HandClock:
    """A stand-in for the ``time`` module the handles read (``monkeypatch.setattr(handles,
    "time", clock)``): ``monotonic()`` says ``now``, which only the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now
