"""Small checks and helpers shared by the public entry points."""

from __future__ import annotations

import math
import numbers
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


def repeated(values: np.ndarray) -> list[int]:
    """The values that occur more than once in ``values``, ascending, each once."""
    ordered = np.sort(values)
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    return [int(v) for v in np.unique(twice)] if twice.size else []


def check_timeout(value: Any, argument: str = "timeout") -> float | None:
    """A caller's timeout: None (the configured default) or a finite number of seconds >= 0.

    Raises InvalidArgumentError naming ``argument`` for anything else (negative, NaN, infinite,
    not a number): every wait has a limit, and none is in the past.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(argument, value, "must be a number of seconds >= 0, or None")
    seconds = float(value)
    if not seconds >= 0:  # negative, or NaN
        raise InvalidArgumentError(argument, value, "must be a number of seconds >= 0, or None")
    if not math.isfinite(seconds):
        raise InvalidArgumentError(argument, value, "must be finite: every wait has a limit")
    return seconds


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` spans with overlapping or touching ones merged."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]
