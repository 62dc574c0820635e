"""Copying a batch of address ranges: one native call, or a Python loop of memmoves.

The native loop (``kvflow._native``, built at install when a C compiler is present) copies a
whole batch in one call without the GIL, and uses non-temporal stores for ranges of at least
``STREAM_MIN_BYTES`` on x86-64, which glibc's memcpy does only for copies of tens of MiB. The
fallback calls ``ctypes.memmove`` per range (about 1 us each, GIL released per call). Setting
``KVFLOW_NATIVE_COPY=0`` in the environment forces the fallback.

Device memory: a thread that copies for KV caches on a GPU first installs a *mover* with
``moving_with`` (``kvflow.devices.CudaDevice`` does, around a store's ``batch_copy``); the host
pools' ``copy_ranges`` calls on that thread then hand their ranges to it instead of copying
with the CPU, as torch's operations go to the thread's current stream. ``issue_ranges`` is the
movers' own loop: one call of a ``cudaMemcpyAsync``-like function per range, in C, without the
GIL.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = [
    "HOST_MEMCPY_ASYNC",
    "NATIVE",
    "MemcpyAsyncFn",
    "STREAM_MIN_BYTES",
    "Mover",
    "copy_ranges",
    "issue_ranges",
    "moving_with",
]

STREAM_MIN_BYTES = 16 << 10

Mover = Callable[[np.ndarray, np.ndarray, np.ndarray], None]  # (dst, src, sizes)

_native: Callable[..., Any] | None
_native_async: Callable[..., Any] | None
try:
    from kvflow import _native as _module  # type: ignore[attr-defined,unused-ignore]

    _native, _native_async = _module.batch_copy, _module.batch_copy_async
    HOST_MEMCPY_ASYNC: int = _module.HOST_MEMCPY_ASYNC
except ImportError:  # built without a compiler: the Python loops serve
    _native = _native_async = None
    HOST_MEMCPY_ASYNC = 0
if os.environ.get("KVFLOW_NATIVE_COPY", "1") == "0":
    _native = _native_async = None

NATIVE: bool = _native is not None
_memmove = ctypes.memmove
# the C type of cudaMemcpyAsync: (dst, src, count, kind, stream) -> error
MemcpyAsyncFn = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
_thread = threading.local()


@contextmanager
def moving_with(mover: Mover) -> Iterator[None]:
    """On this thread, until the block ends, ``copy_ranges`` hands its ranges to ``mover``."""
    outer = getattr(_thread, "mover", None)
    _thread.mover = mover
    try:
        yield
    finally:
        _thread.mover = outer


def copy_ranges(
    dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, *, native: bool = NATIVE
) -> None:
    """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every i (int64 arrays).

    The caller guarantees that every range is valid memory and that no two ranges overlap.
    Inside ``moving_with(mover)`` the thread's mover moves them instead.
    """
    mover = getattr(_thread, "mover", None)
    if mover is not None:
        mover(dst, src, sizes)
        return
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


def issue_ranges(
    fn: int, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int, kind: int
) -> tuple[int, int]:
    """Call the ``cudaMemcpyAsync``-like function at address ``fn`` as
    ``fn(dst[i], src[i], sizes[i], kind, stream)`` for every i, stopping at the first nonzero
    return: ``(index, error)`` of that range, or ``(-1, 0)`` when every range was issued.

    The native loop makes the calls in C without the GIL; the fallback calls through ctypes.
    """
    if not fn:
        raise ValueError("fn is a null function pointer")
    if _native_async is not None:
        failed, error = _native_async(
            np.ascontiguousarray(dst, dtype=np.int64),
            np.ascontiguousarray(src, dtype=np.int64),
            np.ascontiguousarray(sizes, dtype=np.int64),
            fn,
            stream,
            kind,
        )
        return int(failed), int(error)
    if sizes.size and sizes.min() < 0:
        raise ValueError(f"sizes[{int(np.argmin(sizes))}] is negative")
    call = MemcpyAsyncFn(fn)
    for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True)):
        error = call(d, s, n, kind, stream)
        if error:
            return i, int(error)
    return -1, 0
