"""A store wrapper for engine tests: a real LocalStore, counted, with a hook before each copy.

No fake pool: the hook changes only the copies a test chooses (stall, fail, raise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import kvflow
from kvflow.abc import Direction, Store
from kvflow.testing import InstrumentedStore
from tests.support.caches import make_caches
from tests.support.pools import dispose, make_store


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
