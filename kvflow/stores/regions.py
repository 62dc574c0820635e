"""Range checks shared by the stores that copy in this process: no copy outside known memory."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvflow._validate import merge_spans
from kvflow.errors import InvalidArgumentError

__all__ = ["LocalRegions", "check_copy_arrays", "inside_spans"]


def check_copy_arrays(pool: np.ndarray, local: np.ndarray, sizes: np.ndarray) -> None:
    """The three arrays of a ``batch_copy`` are 1-D, of one length, with sizes >= 0."""
    if not (pool.shape == local.shape == sizes.shape) or pool.ndim != 1:
        raise InvalidArgumentError("sizes", sizes.shape, "address and size arrays differ")
    if sizes.size and sizes.min() < 0:
        raise InvalidArgumentError("sizes", int(sizes.min()), "sizes must be >= 0")


def inside_spans(
    starts: np.ndarray, ends: np.ndarray, addrs: np.ndarray, sizes: np.ndarray
) -> np.ndarray:
    """Per range, whether ``[addr, addr + size)`` lies inside one of the sorted, disjoint spans
    ``[starts[i], ends[i])``. Compares sizes with the room left, never ``addr + size``, which
    can wrap past 2**63."""
    if starts.size == 0:
        return np.zeros(addrs.shape, dtype=bool)
    idx = np.searchsorted(starts, addrs, side="right") - 1
    safe = np.maximum(idx, 0)
    inside: np.ndarray = (idx >= 0) & (sizes <= ends[safe] - addrs)
    return inside


class LocalRegions:
    """Local memory that ``register()`` declared; ``check()`` refuses ranges outside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans = np.zeros((0, 2), dtype=np.int64)  # sorted, merged [start, end)

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        spans = [(int(a), int(a) + int(n)) for a, n in regions]
        with self._lock:
            known = [(int(lo), int(hi)) for lo, hi in self._spans.tolist()]
            merged = merge_spans(known + spans)
            self._spans = np.array(merged, dtype=np.int64).reshape(-1, 2)

    def check(self, local: np.ndarray, sizes: np.ndarray) -> None:
        spans = self._spans
        if local.size == 0:
            return
        if spans.shape[0] == 0:
            raise InvalidArgumentError(
                "local_addrs", hex(int(local[0])), "no local memory is registered (call register())"
            )
        inside = inside_spans(spans[:, 0], spans[:, 1], local, sizes)
        if not inside.all():
            bad = int(local[~inside][0])
            raise InvalidArgumentError(
                "local_addrs", hex(bad), "outside every registered region (call register())"
            )
