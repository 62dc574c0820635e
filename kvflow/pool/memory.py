"""The pool's arena in memory: a sealed memfd the server makes once (``make_arena``) and
clears while it serves (``clear_pages``), mapped by every client (``map_shared``); a dropped
mapping's range kept reserved (``reserve``).

Plain calls into the C library (``mmap``, ``munmap``, ``madvise``), each blocking only for the
kernel's work; no state is shared between calls, so any thread may make them.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from collections.abc import Callable

from kvflow.errors import ConfigError, StoreError

__all__ = ["SEALS", "clear_pages", "make_arena", "map_shared", "reserve", "unmap"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10  # Linux
_PROT_NONE = 0
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # the arena's, all of them


def make_arena(size: int) -> int:
    """A memfd of ``size`` bytes, mode 0600, its memory allocated now.

    ``posix_fallocate`` reserves the pages (a client's copy can never fault on a full tmpfs)
    but leaves them to be cleared on their first fault: ``clear_pages`` pays that once, so a
    client's first touch of a page is a minor fault, not a page clear.
    """
    fd = os.memfd_create("kvflow-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        # no client may resize it: a shrink would fault every process that maps it
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        os.close(fd)
        raise ConfigError("capacity", size, f"cannot allocate the arena: {exc}") from exc
    return fd


def clear_pages(addr: int, size: int, stop: Callable[[], bool], piece: int = 64 << 20) -> None:
    """Fault in every page of the mapping at ``addr`` once (the kernel clears each at its
    first fault), ``piece`` bytes at a time, until done or ``stop()``. Nothing in the memory
    changes: a client that touched a page first has it cleared already. Kernels without
    ``MADV_POPULATE_WRITE`` (before 5.14) leave the pages to the clients' first faults."""
    for start in range(0, size, piece):
        if stop() or _libc.madvise(addr + start, min(piece, size - start), _MADV_POPULATE_WRITE):
            return


def map_shared(fd: int, size: int, populate: bool) -> int:
    """Map ``size`` bytes of ``fd`` shared, read-write; returns the address (``munmap`` it).

    With ``populate`` every page is mapped writable now (``MADV_POPULATE_WRITE``, Linux 5.14;
    older kernels get ``MAP_POPULATE``, which maps shared pages read-only, so the first write to
    each still faults). Nothing in the memory changes.
    """
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise StoreError(f"cannot map the pool's arena: {os.strerror(err)}", err)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        _libc.madvise(addr, size, mmap.MADV_HUGEPAGE)  # advice only; shmem THP may be off
    if populate and _libc.madvise(addr, size, _MADV_POPULATE_WRITE) != 0:
        _libc.munmap(addr, size)
        flags = mmap.MAP_SHARED | _MAP_POPULATE
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise StoreError(f"cannot map the pool's arena: {os.strerror(err)}", err)
    return int(addr)


def reserve(addr: int, size: int) -> None:
    """Replace the mapping at ``addr`` with a reservation of its range (no access, no memory),
    so that no later mapping can land where stale addresses point. ``unmap`` frees it."""
    flags = _MAP_FIXED | mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    got = _libc.mmap(addr, size, _PROT_NONE, flags, -1, 0)
    if got != addr:  # cannot happen with MAP_FIXED; never leave the range open
        raise StoreError(f"cannot reserve the old arena: {os.strerror(ctypes.get_errno())}")


def unmap(addr: int, size: int) -> None:
    _libc.munmap(addr, size)
