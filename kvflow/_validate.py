"""Small checks and helpers shared by the public entry points."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvflow.errors import InvalidArgumentError

_INT64_MAX = np.iinfo(np.int64).max


def int_vector(value: Any, argument: str, what: str) -> np.ndarray:
    """``value`` (a sequence, NumPy array or torch tensor) as a 1-D int64 array.

    Refuses ragged or multi-dimensional input, non-integers and values beyond int64, raising
    InvalidArgumentError that names ``argument``; ``what`` names the elements in the message.
    """
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nesting
        raise InvalidArgumentError(argument, value, f"must be a 1-D sequence of {what}") from exc
    if arr.ndim != 1:
        raise InvalidArgumentError(argument, value, f"must be a 1-D sequence of {what}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(argument, value, f"{what} must be integers")
    if arr.size and arr.dtype.kind == "u" and arr.max() > _INT64_MAX:
        raise InvalidArgumentError(argument, int(arr.max()), f"{what} must fit in int64")
    return arr.astype(np.int64, copy=False)


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` spans with overlapping or touching ones merged."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]
