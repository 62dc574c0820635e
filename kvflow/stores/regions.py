"""Range checks shared by the stores that copy in this process: no copy outside known memory."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

from kvflow._validate import merge_spans
from kvflow.errors import InvalidArgumentError
from kvflow.stores.base import Direction

__all__ = ["HeldSpans", "LocalRegions", "check_copy_arrays", "in_range", "inside_spans"]


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

    def check_call(
        self, pool: np.ndarray, local: np.ndarray, sizes: np.ndarray, direction: Direction
    ) -> None:
        """A ``batch_copy`` call's arguments: the arrays' shapes and sizes, the direction, and
        every local range inside registered memory (raising InvalidArgumentError)."""
        check_copy_arrays(pool, local, sizes)
        if direction not in (Direction.TO_POOL, Direction.FROM_POOL):
            raise InvalidArgumentError("direction", direction, "expected a Direction")
        self.check(local, sizes)

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


def in_range(base: int, size: int, addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per range: whether ``[addr, addr + size)`` lies inside ``[base, base + size)``."""
    room = base + size - addrs  # compare with the room left, never addr + size (wraps)
    inside: np.ndarray = (addrs >= base) & (addrs <= base + size) & (sizes <= room)
    return inside


class HeldSpans:
    """Memory a client holds in a pool, per session: sorted arrays for vectorised checks.

    Each session adds ``[starts[i], ends[i])`` spans with one deadline (``inf`` for write
    grants) and an ``owner`` (its connection), so every span of a lost connection goes at once.
    Not thread-safe: the owner serialises calls. ``version`` changes whenever a span comes or
    goes, so a check made earlier can be reused while it is unchanged.
    """

    def __init__(self) -> None:
        self.version = 0
        self._by_handle: dict[int, tuple[np.ndarray, np.ndarray, float, object]] = {}
        self._starts = self._ends = np.zeros(0, dtype=np.int64)
        self._deadlines = np.zeros(0)

    def add(
        self, handle: int, starts: np.ndarray, ends: np.ndarray, deadline: float, owner: object
    ) -> None:
        self._by_handle[handle] = (starts, ends, deadline, owner)
        self._rebuild()

    def remove(self, handle: int) -> None:
        if self._by_handle.pop(handle, None) is not None:
            self._rebuild()

    def drop(self, owner: object) -> None:
        self._by_handle = {h: v for h, v in self._by_handle.items() if v[3] is not owner}
        self._rebuild()

    def cover(
        self, addrs: np.ndarray, sizes: np.ndarray, now: float | None
    ) -> tuple[np.ndarray, float]:
        """Per range: inside one held span (and, given ``now``, before its deadline); and the
        earliest deadline among the spans covering the ranges."""
        starts = self._starts
        if starts.size == 0 or addrs.size == 0:
            return np.zeros(addrs.shape, dtype=bool), math.inf
        idx = np.maximum(np.searchsorted(starts, addrs, side="right") - 1, 0)
        inside: np.ndarray = (starts[idx] <= addrs) & (sizes <= self._ends[idx] - addrs)
        if now is None:
            return inside, math.inf
        deadlines = self._deadlines[idx]
        inside &= deadlines > now
        return inside, float(deadlines[inside].min()) if inside.any() else math.inf

    def _rebuild(self) -> None:
        self.version += 1
        held = list(self._by_handle.values())
        if not held:
            self._starts = self._ends = np.zeros(0, dtype=np.int64)
            self._deadlines = np.zeros(0)
            return
        starts = np.concatenate([h[0] for h in held])
        ends = np.concatenate([h[1] for h in held])
        deadlines = np.concatenate([np.full(h[0].size, h[2]) for h in held])
        order = np.lexsort((deadlines, starts))  # one object leased twice: later deadline last
        self._starts, self._ends, self._deadlines = starts[order], ends[order], deadlines[order]
