"""Copying a batch of address ranges: one native call, or a Python loop of memmoves.

The native loop (``kvflow._native``, built at install when a C compiler is present) copies a
whole batch in one call without the GIL, and uses non-temporal stores for ranges of at least
``STREAM_MIN_BYTES`` on x86-64, which glibc's memcpy does only for copies of tens of MiB. The
fallback calls ``ctypes.memmove`` per range (about 1 us each, GIL released per call). Setting
``KVFLOW_NATIVE_COPY=0`` in the environment forces the fallback.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["NATIVE", "STREAM_MIN_BYTES", "copy_ranges"]

STREAM_MIN_BYTES = 16 << 10

_native: Callable[..., Any] | None
try:
    from kvflow import _native as _module  # type: ignore[attr-defined,unused-ignore]

    _native = _module.batch_copy
except ImportError:  # built without a compiler: the Python loop serves
    _native = None
if os.environ.get("KVFLOW_NATIVE_COPY", "1") == "0":
    _native = None

NATIVE: bool = _native is not None
_memmove = ctypes.memmove


def copy_ranges(
    dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, *, native: bool = NATIVE
) -> None:
    """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every i (int64 arrays).

    The caller guarantees that every range is valid memory and that no two ranges overlap.
    """
    if native and _native is not None:
        _native(
            np.ascontiguousarray(dst, dtype=np.int64),
            np.ascontiguousarray(src, dtype=np.int64),
            np.ascontiguousarray(sizes, dtype=np.int64),
            STREAM_MIN_BYTES,
        )
        return
    for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
        _memmove(d, s, n)
