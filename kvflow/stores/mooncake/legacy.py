"""Mooncake without its session calls (releases before them): what MooncakeStore does instead.

``open_write`` reserves nothing (it only asks which keys exist); each layer's ``batch_copy``
stages its ranges in the session (``stage``), and ``finish_write`` puts the objects whose
staged ranges cover them whole (``whole_objects``) with ``batch_put_from_multi_buffers``: the
local memory must stay unchanged until then. A load makes one ``get_into_ranges`` call per
layer (``get_ranges``), a master lookup each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from kvflow.stores.mooncake.slots import Session

__all__ = ["get_ranges", "stage", "whole_objects"]


def stage(
    sessions: Iterable[Session],
    groups: list[np.ndarray],
    slots: np.ndarray,
    offsets: np.ndarray,
    local: np.ndarray,
    sizes: np.ndarray,
) -> None:
    """Add each group's ranges (offset, local pointer, size) to the object of its slot."""
    sessions = list(sessions)
    for g in groups:
        slot = int(slots[g[0]])
        ranges = list(zip(offsets[g].tolist(), local[g].tolist(), sizes[g].tolist(), strict=True))
        for s in sessions:
            for pos, sl in s.slots.items():
                if sl == slot:
                    s.pending.setdefault(pos, []).extend(ranges)


def whole_objects(
    staged: list[list[tuple[int, int, int]]], nbytes: int
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Of the objects' staged ranges (offset, local pointer, size), the indexes of those that
    cover their ``nbytes`` exactly, in order, with their local pointers and sizes."""
    put: list[int] = []
    ptrs: list[list[int]] = []
    sizes: list[list[int]] = []
    for i, ranges in enumerate(staged):
        ranges = sorted(ranges)
        ends = np.cumsum([r[2] for r in ranges]) if ranges else np.zeros(0)
        starts = [r[0] for r in ranges]
        if ranges and starts == [0, *ends[:-1].tolist()] and ends[-1] == nbytes:
            put.append(i)
            ptrs.append([r[1] for r in ranges])
            sizes.append([r[2] for r in ranges])
    return put, ptrs, sizes


def get_ranges(
    client: Any,
    keys: list[str],
    ptrs: list[list[int]],
    lens: list[list[int]],
    offs: list[list[int]],
) -> list[int]:
    """One layer's load: ``get_into_ranges`` relative to the lowest address; per key, the
    bytes read, or -1."""
    base = min(min(p) for p in ptrs)
    dst = [[p - base for p in group] for group in ptrs]
    got = client.get_into_ranges([base], [keys], [dst], [offs], [lens])
    return [
        sum(int(x) for x in per_key) if all(int(x) >= 0 for x in per_key) else -1
        for per_key in got[0]
    ]
