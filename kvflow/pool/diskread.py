"""DiskReads: the disk tier's objects a SharedStore reads itself, layer by layer.

The pool server answers a read of a chunk held on disk only with its size and no lease
(``protocol.ON_DISK``); the client opens the object's file at ``open_read`` (``open``: the
header is read and checked against the key) and hands the engine an address for it in a range
no memory uses (``TAG`` and up, ``SPAN`` bytes per object). The engine computes each layer's
ranges from it as from an arena address; ``batch_copy`` gives those ranges to ``stage``,
which reads, per object, the checksummed spans they touch into a buffer (one ``preadv`` per
object per layer) and verifies each checksum before any byte is copied out. Each file is read
front to back, a layer at a time, so the kernel's readahead sees one sequential reader per file
and reads ahead of it (asking for the next spans with ``POSIX_FADV_WILLNEED`` measured slower:
1.0 against 1.7-1.85 GB/s for 48 files read a layer at a time, page cache dropped). An object
that fails (a checksum, a short file, an I/O error) fails all its ranges, and its key is kept in
``bad`` for the server to delete (``DISK_DROP``). The open file holds the object's bytes while
the chunk loads: a file the server evicts or replaces meanwhile is still read whole.

Thread-safe: ``stage`` runs on several copy threads at once; one lock guards the open objects.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvflow.errors import InvalidArgumentError
from kvflow.pool.diskfiles import ObjectHeader, mismatch, object_header, object_path

__all__ = ["SPAN", "TAG", "DiskReads", "Staged"]

TAG = 1 << 56  # above every user-space address
SPAN = 1 << 36  # address space per open object (a payload is smaller)
_SLOTS = 1 << 19  # objects open at once, at most, before an address comes round again


@dataclass(frozen=True, eq=False)
class _Object:
    key: str
    fd: int
    header: ObjectHeader


class Staged(NamedTuple):
    """What ``stage`` read: per range, its bytes' address in ``buffer`` and whether it came
    whole and verified."""

    src: np.ndarray
    ok: np.ndarray
    buffer: np.ndarray  # the thread's staging buffer: copy out before its next ``stage``


class DiskReads:
    """Open disk objects by address; counters ``opened``, ``open_failed``, ``read_bytes``,
    ``failed`` (objects that failed a read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, _Object] = {}
        self._slots = itertools.count()
        self._local = threading.local()  # each copy thread's staging buffer
        self.bad: set[str] = set()
        self.opened = self.open_failed = self.read_bytes = self.failed = 0

    def open(self, root: str, keys: Sequence[str]) -> list[int | None]:
        """Open the objects of ``keys`` under ``root``: their addresses, None for one gone or
        not valid."""
        paths = [object_path(root, key) for key in keys]
        return [self._opened(key, path) for key, path in zip(keys, paths, strict=True)]

    def _opened(self, key: str, path: str) -> int | None:
        """The address of ``key``'s object file ``path``, opened, once its header checks out."""
        fd = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            header = object_header(fd, path, key)
        except (OSError, ValueError) as exc:
            if fd is not None:
                os.close(fd)
            with self._lock:
                self.open_failed += 1
                if not isinstance(exc, OSError) or isinstance(exc, FileNotFoundError):
                    self.bad.add(key)  # not valid, or gone: the pool must stop answering it
            return None
        with self._lock:
            while True:  # an address no open object has
                base = TAG + (next(self._slots) % _SLOTS) * SPAN
                if base not in self._open:
                    break
            self._open[base] = _Object(key, fd, header)
            self.opened += 1
        return base

    def close(self, bases: Sequence[int]) -> None:
        """Close the objects at ``bases`` (those open)."""
        with self._lock:
            objects = [self._open.pop(int(b)) for b in bases if int(b) in self._open]
        for obj in objects:
            with contextlib.suppress(OSError):
                os.close(obj.fd)

    def __repr__(self) -> str:
        return (
            f"DiskReads(open={len(self._open)}, opened={self.opened}, "
            f"open_failed={self.open_failed}, read_bytes={self.read_bytes}, failed={self.failed})"
        )

    def take_bad(self) -> list[str]:
        """The keys found bad since the last call."""
        with self._lock:
            bad, self.bad = sorted(self.bad), set()
        return bad

    def tagged(self, pool: np.ndarray) -> np.ndarray | None:
        """Which of the addresses ``pool`` are disk objects'; None when none is (or no object
        is open: then they are nobody's, and the arena's checks refuse them)."""
        if not self._open:
            return None
        mask = pool >= TAG
        return mask if mask.any() else None

    def stage(self, pool: np.ndarray, sizes: np.ndarray) -> Staged:
        """Read and verify the bytes of the ranges (``pool``: disk object addresses). A range
        outside every open object is refused (InvalidArgumentError), nothing read."""
        bases = TAG + (pool - TAG) // SPAN * SPAN
        offsets = pool - bases
        ok = np.zeros(len(pool), dtype=bool)
        src = np.zeros(len(pool), dtype=np.int64)
        # the ranges grouped by object (one sort), each object's lowest and highest byte
        order = np.argsort(bases, kind="stable")
        uniq, first = np.unique(bases[order], return_index=True)
        lows = np.minimum.reduceat(offsets[order], first)
        highs = np.maximum.reduceat((offsets + sizes)[order], first)
        groups = np.split(order, first[1:])
        with self._lock:
            objects = {b: self._open.get(b) for b in uniq.tolist()}
        spans: list[tuple[int, int, int, np.ndarray]] = []  # (base, start, length, its ranges)
        total = 0
        per_object = zip(uniq.tolist(), lows.tolist(), highs.tolist(), groups, strict=True)
        for base, lo, hi, at in per_object:
            obj = objects[base]
            if obj is None or hi > obj.header.payload:
                bad = hex(int(pool[at[0]]))
                raise InvalidArgumentError("pool_addrs", bad, "outside every disk object held")
            start, length = obj.header.spanning(lo, hi - lo)
            spans.append((base, start, length, at))
            total += length
        buffer = self._buffer(total)
        where = 0
        for base, start, length, at in spans:
            obj = objects[base]
            assert obj is not None
            view = buffer[where : where + length].data
            if self._read(obj, view, start):
                ok[at] = True
                src[at] = buffer.ctypes.data + where + (offsets[at] - start)
            where += length
        return Staged(src, ok, buffer)

    def _buffer(self, size: int) -> np.ndarray:
        """This thread's staging buffer, at least ``size`` bytes (kept for its next call: a
        fresh one would fault in every page again)."""
        held: np.ndarray | None = getattr(self._local, "buffer", None)
        if held is None or held.size < size:
            held = self._local.buffer = np.empty(
                max(size, 2 * (0 if held is None else held.size)), np.uint8
            )
        return held[:size]

    def _read(self, obj: _Object, view: memoryview, start: int) -> bool:
        """Read payload bytes from ``start`` into ``view`` and verify them."""
        try:
            got = 0
            while got < len(view):
                n = os.preadv(obj.fd, [view[got:]], obj.header.header + start + got)
                if n == 0:
                    break
                got += n
            good = got == len(view)
            if good:
                covered = obj.header.covered(start, len(view))
                good = mismatch(obj.key, view, start, covered) is None
        except OSError:
            good = False
        with self._lock:
            if good:
                self.read_bytes += len(view)
            else:
                self.failed += 1
                self.bad.add(obj.key)
        return good
