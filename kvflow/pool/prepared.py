"""ArenaWrites: a save's copies into the pool's arena, checked once for every layer.

``batch_copy`` checks its arrays, the local memory, the arena and the client's write slots at
every call. On a producer's thread (inline saves), right after a layer's compute, those checks
take many times the layer's memmove. ``SharedStore.prepare_writes`` makes them once, when the
save opens, for all its layers; ``copy(layer)`` then checks only what may have changed since:

- the connection: a dropped one took every write slot with it, so nothing is copied and every
  range fails (where ``batch_copy`` finds no connection it raises StoreUnavailableError, which
  fails every range too);
- the write slots: when a session came or went since (``HeldSpans.version``), the layer's
  ranges are checked against them again, as ``batch_copy`` does, so a range whose slot was
  given up is never written.

The copy is in flight for the link as ``batch_copy``'s is: a dropped connection waits for it
before its memory goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvflow.copying.host import copy_ranges
from kvflow.errors import InvalidArgumentError
from kvflow.stores.regions import LocalRegions, check_copy_arrays

if TYPE_CHECKING:
    from kvflow.pool.link import PoolLink

__all__ = ["ArenaWrites", "Ranges"]

Ranges = tuple[np.ndarray, np.ndarray, np.ndarray]  # a layer's (pool, local, sizes)


class ArenaWrites:
    """``copy(i)`` is ``batch_copy(*layers[i], TO_POOL)`` of the SharedStore on ``link``, made
    by ``prepare``. Thread-safe: layers may be copied from several threads at once, in any
    order. After the session's ``finish_write`` (or the store's close) its slots are gone and
    each copy fails every range (raises ClosedError after the close)."""

    def __init__(self, link: PoolLink, layers: list[Ranges], native: bool) -> None:
        """``layers``: arrays of this object's own, checked already (``prepare``)."""
        self._link, self._layers, self._native = link, layers, native
        joined = [np.concatenate(arrays) for arrays in zip(*layers, strict=True)]
        self._conn, self._version, held = link.writes_held(joined[0], joined[2])
        ends = np.cumsum([len(sizes) for _, _, sizes in layers])
        self._ready = [  # per layer, what to copy while the slots are unchanged, and what fails
            _ready(ranges, ok) for ranges, ok in zip(layers, np.split(held, ends[:-1]), strict=True)
        ]

    @classmethod
    def prepare(
        cls,
        link: PoolLink,
        regions: LocalRegions,
        layers: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
        native: bool,
    ) -> ArenaWrites | None:
        """The layers' arrays copied (read-only: what was checked is what is copied) and
        checked as ``batch_copy`` checks them, the local ranges in one go; None for none."""
        own: list[Ranges] = []
        for ranges in layers:
            pool, local, sizes = (np.array(a, dtype=np.int64) for a in ranges)
            check_copy_arrays(pool, local, sizes)
            for array in (pool, local, sizes):
                array.setflags(write=False)
            own.append((pool, local, sizes))
        if not own:
            return None
        regions.check(np.concatenate([r[1] for r in own]), np.concatenate([r[2] for r in own]))
        return cls(link, own, native)

    def __len__(self) -> int:
        return len(self._layers)

    def copy(self, layer: int) -> np.ndarray:
        """Copy layer ``layer``'s ranges to the pool; the indices of those that failed."""
        if isinstance(layer, bool) or not 0 <= layer < len(self._layers):
            raise InvalidArgumentError("layer", layer, f"expected 0 to {len(self._layers) - 1}")
        pool, local, sizes = self._layers[layer]
        held = self._link.write_copy_started(self._conn, self._version, pool, sizes)
        try:
            if self._conn.peer_gone():
                held = np.zeros(sizes.shape, dtype=bool)
            if held is None:
                dst, src, n, failed = self._ready[layer]
            else:
                dst, src, n, failed = pool[held], local[held], sizes[held], np.flatnonzero(~held)
            if len(n):
                copy_ranges(dst, src, n, native=self._native)
        finally:
            self._link.copy_ended()
        return failed

    def __repr__(self) -> str:
        return f"ArenaWrites(layers={len(self._layers)}, conn={self._conn!r})"


def _ready(ranges: Ranges, ok: np.ndarray) -> tuple[np.ndarray, ...]:
    """A layer's (dst, src, sizes) to copy, and the indices that fail, given which are held."""
    pool, local, sizes = ranges
    if ok.all():
        return pool, local, sizes, np.zeros(0, dtype=np.int64)
    return pool[ok], local[ok], sizes[ok], np.flatnonzero(~ok)
