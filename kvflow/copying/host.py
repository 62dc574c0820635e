"""Copying a batch of address ranges: one native call, or a Python loop of memmoves.

The native loop (``kvflow._native``, built at install when a C compiler is present) copies a
whole batch in one call without the GIL. On x86-64 it can copy ranges of at least
``STREAM_MIN_BYTES`` with non-temporal stores, which glibc's memcpy does only for copies of
tens of MiB: on the Xeons measured that took per-range copies from ~58 % of one big memcpy to
95-105 %, but on an AMD EPYC VM streaming ran at 2.6 GB/s against memcpy's 8.5. So whether it
streams is measured once per process (``stream_min_bytes``, ~50 ms, at the start of the first
engine on host memory, or else at the first native copy); ``KVFLOW_STREAM_COPY=1`` or ``0``
decides it instead. The fallback calls ``ctypes.memmove`` per range (about 1 us each, GIL
released per call). Setting ``KVFLOW_NATIVE_COPY=0`` in the environment forces the fallback.

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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import import_module
from typing import Any

import numpy as np

from kvflow.errors import ConfigError

__all__ = [
    "HOST_MEMCPY_ASYNC",
    "NATIVE",
    "MemcpyAsyncFn",
    "STREAM_MIN_BYTES",
    "Mover",
    "copy_ranges",
    "issue_ranges",
    "moving_with",
    "stream_min_bytes",
]

STREAM_MIN_BYTES = 16 << 10
STREAM_ENV = "KVFLOW_STREAM_COPY"

Mover = Callable[[np.ndarray, np.ndarray, np.ndarray], None]  # (dst, src, sizes)

_native: Callable[..., Any] | None
_native_async: Callable[..., Any] | None
try:
    _module: Any = import_module("kvflow._native")  # compiled, without type information

    _native, _native_async = _module.batch_copy, _module.batch_copy_async
    HOST_MEMCPY_ASYNC: int = _module.HOST_MEMCPY_ASYNC
    _STREAMING = bool(_module.STREAMING)
except ImportError:  # built without a compiler: the Python loops serve
    _native = _native_async = None
    HOST_MEMCPY_ASYNC = 0
    _STREAMING = False
if os.environ.get("KVFLOW_NATIVE_COPY", "1") == "0":
    _native = _native_async = None

NATIVE: bool = _native is not None
_memmove = ctypes.memmove
# the C type of cudaMemcpyAsync: (dst, src, count, kind, stream) -> error
MemcpyAsyncFn = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
_thread = threading.local()
_stream_min: int | None = None  # measured once: see stream_min_bytes
_measuring = threading.Lock()


@contextmanager
def moving_with(mover: Mover) -> Iterator[None]:
    """On this thread, until the block ends, ``copy_ranges`` hands its ranges to ``mover``."""
    outer = getattr(_thread, "mover", None)
    _thread.mover = mover
    try:
        yield
    finally:
        _thread.mover = outer


def stream_min_bytes() -> int:
    """The smallest range the native loop copies with non-temporal stores; 0: it never
    streams. Decided once per process, thread-safe: by ``KVFLOW_STREAM_COPY`` (``1``: stream
    ranges of ``STREAM_MIN_BYTES`` and more, ``0``: never, ``auto``: the default) or by timing
    both ways. The first call that times blocks ~50 ms and touches 128 MiB for that (the first
    engine on host memory makes it, at its start); later calls return at once."""
    global _stream_min
    if _stream_min is None:
        with _measuring:
            if _stream_min is None:
                _stream_min = _choose_stream_min()
    return _stream_min


def _choose_stream_min() -> int:
    setting = os.environ.get(STREAM_ENV, "auto")
    if setting not in ("auto", "0", "1"):
        raise ConfigError(STREAM_ENV, setting, 'expected "auto", "0" or "1"')
    if _native is None or not _STREAMING or setting == "0":
        return 0
    if setting == "1":
        return STREAM_MIN_BYTES
    streamed, plain = _time_both()
    return STREAM_MIN_BYTES if streamed < plain else 0


def _time_both(total: int = 64 << 20, piece: int = 8 << 20, rounds: int = 4) -> tuple[float, float]:
    """Median seconds to copy ``piece`` bytes as 256 KiB ranges (the size of a typical
    chunk's layer part), streamed and with memcpy: each copy on a slice of ``total``-byte
    buffers of its own (both touched first: no page faults in the timing), the two ways taking
    turns at going first."""
    assert _native is not None
    src = np.ones(total, dtype=np.uint8)
    dst = np.ones(total, dtype=np.uint8)
    step = 256 << 10
    offsets = np.arange(piece // step, dtype=np.int64) * step
    sizes = np.full(offsets.size, step, dtype=np.int64)
    slices = total // piece
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(rounds * 2):
        way = (i + i // 2) % 2  # 0 1, 1 0, 0 1, ...: streamed first in every other round
        base = i % slices * piece
        start = time.perf_counter()
        _native(
            dst.ctypes.data + base + offsets,
            src.ctypes.data + base + offsets,
            sizes,
            STREAM_MIN_BYTES if way == 0 else 0,
        )
        times[way].append(time.perf_counter() - start)
    return float(np.median(times[0])), float(np.median(times[1]))


def copy_ranges(
    dst: np.ndarray,
    src: np.ndarray,
    sizes: np.ndarray,
    *,
    native: bool = NATIVE,
    stream_min: int | None = None,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every i (int64 arrays).

    The caller guarantees that every range is valid memory and that no two ranges overlap.
    Inside ``moving_with(mover)`` the thread's mover moves them instead. ``stream_min``: the
    native loop's streaming threshold (default ``stream_min_bytes()``; 0: never stream).
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
            stream_min_bytes() if stream_min is None else stream_min,
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
