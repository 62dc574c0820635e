"""The CUDA runtime calls kvflow needs, found in the process at run time, never linked.

kvflow builds no CUDA code. When KV caches live on a CUDA device, torch has loaded the CUDA
runtime library (``libcudart``); ``runtime()`` finds it among the libraries mapped into the
process and calls four of its functions through ctypes:

* ``cudaMemcpyAsync``: its address goes to the native copy loop
  (``kvflow.copying.host.issue_ranges``), which calls it once per coalesced range, without
  the GIL, on the copy thread's stream;
* ``cudaHostRegister`` / ``cudaHostUnregister``: page-lock a host pool's arena, so a copy to or
  from it is a true asynchronous DMA (pageable memory is staged by the driver, and its copies
  return only when done);
* ``cudaGetErrorString``: errors name what went wrong.

``pin_host`` pins an arena when asked (``pin=True``) or, by default (``pin=None``), when a CUDA
GPU is present. Pinning locks every page of the range: a large arena takes a while (about a
second per several GiB) and the memory can no longer be swapped.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvflow.errors import ConfigError, KVFlowError, MissingDependencyError, StoreError

__all__ = [
    "MEMCPY_DEFAULT",
    "CopyRuntime",
    "CudaRuntime",
    "gpu_present",
    "pin_host",
    "runtime",
]

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the addresses (unified VA)
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process, not just the current
log = logging.getLogger("kvflow")
_NO_GPU = "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"


class CopyRuntime(Protocol):
    """What a CUDA device's copies need of a runtime (``CudaRuntime``, or a stand-in)."""

    memcpy_async_addr: int  # a function with cudaMemcpyAsync's signature

    def error_string(self, code: int) -> str: ...


class CudaRuntime:
    """The few CUDA runtime functions kvflow calls, bound from one loaded ``libcudart``.

    Thread-safe (the runtime is). ``memcpy_async_addr`` is ``cudaMemcpyAsync``'s address for
    the native copy loop; ``memcpy_async`` the same function callable from Python.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.path = getattr(lib, "_name", "?")
        self.memcpy_async = lib.cudaMemcpyAsync
        self.memcpy_async.restype = ctypes.c_int
        self.memcpy_async.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self.memcpy_async_addr = int(ctypes.cast(self.memcpy_async, ctypes.c_void_p).value or 0)
        self._register = lib.cudaHostRegister
        self._register.restype = ctypes.c_int
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._unregister = lib.cudaHostUnregister
        self._unregister.restype = ctypes.c_int
        self._unregister.argtypes = [ctypes.c_void_p]
        self._error_string = lib.cudaGetErrorString
        self._error_string.restype = ctypes.c_char_p
        self._error_string.argtypes = [ctypes.c_int]

    def error_string(self, code: int) -> str:
        text = self._error_string(code)
        return text.decode() if text else "unknown CUDA error"

    def host_register(self, addr: int, nbytes: int) -> None:
        """Page-lock ``[addr, addr + nbytes)`` for every CUDA context; StoreError if refused."""
        code = self._register(addr, nbytes, _HOST_REGISTER_PORTABLE)
        if code != 0:
            raise StoreError(
                f"cudaHostRegister of {nbytes} bytes at {addr:#x}: {self.error_string(code)}", code
            )

    def host_unregister(self, addr: int) -> None:
        self._unregister(addr)  # an error here leaves nothing to undo: the range goes away next

    def __repr__(self) -> str:
        return f"CudaRuntime({self.path!r})"


def gpu_present() -> bool:
    """Whether torch sees a CUDA GPU (False on CPU builds of torch, at no cost)."""
    import torch

    return bool(torch.cuda.is_available())


@functools.cache
def runtime() -> CudaRuntime:
    """The process's CUDA runtime: the ``libcudart`` torch loaded, else one by its usual names.

    Raises ConfigError where torch sees no GPU, MissingDependencyError where no runtime loads.
    """
    import torch

    if not gpu_present():
        raise ConfigError("device", "cuda", _NO_GPU)
    torch.cuda.init()  # loads torch's CUDA libraries and creates the primary context
    candidates = [*_mapped("libcudart"), "libcudart.so"]
    major = (torch.version.cuda or "").split(".")[0]
    if major:
        candidates.insert(1, f"libcudart.so.{major}")
    for name in candidates:
        try:
            return CudaRuntime(ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    raise MissingDependencyError(
        f"CUDA copies (no libcudart among {candidates})", "nvidia-cuda-runtime"
    )


def _mapped(stem: str) -> list[str]:
    """Paths of the libraries named ``stem*`` mapped into this process, first seen first."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = [line.split(None, 5)[-1] for line in lines if f"/{stem}" in line]
    return list(dict.fromkeys(p for p in paths if p.startswith("/")))


def pin_host(addr: int, nbytes: int, pin: bool | None) -> Callable[[], None] | None:
    """Page-lock a host range for DMA: always (``True``), never (``False``) or when a CUDA GPU
    is present (``None``). Returns the call that unpins it (once, before the range is unmapped),
    or None if nothing was pinned. ``pin=True`` without a GPU raises ConfigError, and a refused
    registration StoreError (no runtime: MissingDependencyError); by default either is logged
    and the range stays pageable."""
    if pin is False or (pin is None and not gpu_present()):
        return None
    if not gpu_present():
        raise ConfigError("pin", pin, _NO_GPU)
    try:
        rt = runtime()
        rt.host_register(addr, nbytes)
    except KVFlowError as exc:
        if pin:
            raise
        log.warning("kvflow: host memory not pinned, GPU copies will be slower: %s", exc)
        return None
    done = False

    def unpin() -> None:
        nonlocal done
        if not done:
            done = True
            rt.host_unregister(addr)

    return unpin
