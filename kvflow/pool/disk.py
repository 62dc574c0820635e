"""DiskObjects: a pool's objects (chunks) as files on a local disk, found again after a restart.

Files and their format: ``kvflow.pool.diskfiles`` (the caller chooses the checksum ranges).
Puts are atomic (``kvflow.pool.diskfiles.write_object``). At start leftover ``.tmp`` files are
removed, each header is checked (magic, version, header crc, the key's hash against the file's
name, the file's size), invalid files are deleted, and the valid objects are indexed, least
recently modified first; payload checksums are verified on read, never at start (too slow on a
large disk). A read covers whole ranges and verifies each; an object that fails is dropped.

Eviction takes the least recently used object not being read. ``lookup`` and ``touch`` touch
their keys last to first, as the DRAM arena does (``kvflow.stores.arena``): keys named in prefix
order leave a prefix's head newer than its tail, so its tail is evicted first. A put makes its
key the most recently used (stored or already there); reads do not reorder.

Thread-safe: one lock guards the index and the counters, and no file I/O runs under it (only
the rate-limited log lines are written under it). A key being written, read or deleted is
marked so: eviction and ``remove`` leave a key being read or
written alone, and a ``put`` of a key being written or deleted writes nothing and returns
False. Every call blocks for its own I/O only. I/O trouble is never raised: put and read return
False, count it and log one line per kind of trouble a minute.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from kvflow.errors import ClosedError, ConfigError, InvalidArgumentError
from kvflow.kinds import parse_size
from kvflow.pool.diskfiles import (
    FORMAT_DIR,
    PAGE,
    SUFFIX,
    TMP,
    ObjectHeader,
    check_ranges,
    encode,
    list_files,
    lock_folder,
    mismatch,
    object_path,
    read_header,
    read_into,
    unlink_quietly,
    write_object,
)

__all__ = ["DiskObjects", "DiskStats", "check_folder"]

log = logging.getLogger("kvflow.pool")

_WARN_EVERY_S = 60.0  # one warning line per kind of trouble in this long


@dataclass(frozen=True)
class DiskStats:
    """What the tier holds and what it counted since it started."""

    objects: int
    bytes: int  # the files' sizes, headers included
    capacity: int
    hits: int
    misses: int  # of lookups
    reads: int
    read_bytes: int
    writes: int
    write_bytes: int  # payload bytes put
    evictions: int
    io_errors: int
    no_space: int  # ENOSPC (counted in io_errors too)
    corrupt: int  # a checksum failed, a file was short or gone
    recovered: int  # objects found at start
    discarded: int  # invalid files removed at start


class _Warnings:
    """One log line per kind of trouble per ``every`` seconds; the next says how many it held."""

    def __init__(self, every: float = _WARN_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self._every, self._clock = every, clock
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warn(self, kind: str, message: str) -> None:
        now = self._clock()
        if kind in self._last and now - self._last[kind] < self._every:
            self._held[kind] += 1
            return
        held, self._last[kind] = self._held.pop(kind, 0), now
        log.warning("disk tier: %s%s", message, f" ({held} more since the last)" if held else "")


def check_folder(directory: str | os.PathLike[str], capacity: int | str) -> int:
    """``capacity`` in bytes, once checked as at start, creating nothing (ConfigError naming
    ``disk_dir`` or ``disk_capacity``; see ``DiskObjects``)."""
    size = parse_size(capacity, argument="disk_capacity")
    folder = os.path.abspath(directory)
    path = folder
    while not os.path.lexists(path):  # the nearest existing ancestor must take the new dirs
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise ConfigError("disk_dir", folder, f"{path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("disk_dir", folder, f"{path} is not writable")
    others = sorted(
        name
        for name in (os.listdir(folder) if path == folder else ())
        if name.startswith("kvflow-disk-") and name != FORMAT_DIR
    )
    if others:
        log.info("disk tier: ignoring %s in %s (another disk format)", others, path)
    if size < PAGE:
        raise ConfigError("disk_capacity", size, f"must be at least {PAGE} bytes")
    held = sum(n for _, _, n in list_files(os.path.join(folder, FORMAT_DIR, "objects"), SUFFIX))
    fs = os.statvfs(path)
    room = fs.f_bavail * fs.f_frsize + held
    if size > room:
        raise ConfigError(
            "disk_capacity",
            size,
            f"the filesystem of {folder} has {room:,} bytes free"
            + (f" (with the {held:,} this tier holds there)" if held else ""),
        )
    return size


class DiskObjects:
    """Objects of a pool on disk under ``directory``, at most ``capacity`` bytes of files.

    Refuses (ConfigError naming ``disk_dir`` or ``disk_capacity``, creating nothing) a path that
    is not a writable directory, or a capacity under one page or over the free space of the
    directory's filesystem plus what this tier already holds there.
    """

    def __init__(self, directory: str | os.PathLike[str], capacity: int | str) -> None:
        self.capacity = check_folder(directory, capacity)
        self.directory = os.path.abspath(directory)
        self._root = os.path.join(self.directory, FORMAT_DIR, "objects")
        for path in (self._root, os.path.dirname(self._root)):
            os.makedirs(path, mode=0o700, exist_ok=True)
            os.chmod(path, 0o700)
        self._lock_fd = lock_folder(os.path.join(os.path.dirname(self._root), "lock"), directory)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, ObjectHeader] = OrderedDict()  # least recently used first
        self._readers: Counter[str] = Counter()
        self._busy: set[str] = set()  # being written or deleted
        self._used = 0
        self._reserved = 0  # puts under way
        self._closed = False
        self._counts: Counter[str] = Counter()
        self._warnings = _Warnings()
        self._recover()

    # -- the index: no I/O ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        """Which ``keys`` are stored; those found are touched, last to first."""
        with self._lock:
            self._check_open()
            found = np.array([key in self._index for key in keys], dtype=bool)
            self._touch(keys)
            self._counts["hits"] += int(found.sum())
            self._counts["misses"] += len(keys) - int(found.sum())
        return found

    def sizes(self, keys: Sequence[str]) -> np.ndarray:
        """The payload size of each of ``keys`` (0 where not stored); no touch, not counted."""
        with self._lock:
            self._check_open()
            index = self._index
            return np.array([index[k].payload if k in index else 0 for k in keys], np.int64)

    @property
    def root(self) -> str:
        """The folder of the object files (a key's file: ``diskfiles.object_path``)."""
        return self._root

    def touch(self, keys: Sequence[str]) -> None:
        """Make the stored ``keys`` the most recently used, touched last to first: keys named
        in prefix order leave the head newer than the tail, and eviction takes tails first."""
        with self._lock:
            self._check_open()
            self._touch(keys)

    def stats(self) -> DiskStats:
        counted = [f.name for f in fields(DiskStats)][3:]
        with self._lock:
            c = self._counts
            return DiskStats(len(self._index), self._used, self.capacity, *(c[n] for n in counted))

    def close(self) -> None:
        """Refuse further calls (ClosedError); calls under way finish. The folder's lock is
        released (another DiskObjects may open it)."""
        with self._lock:
            self._closed = True
            fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    # -- writes -----------------------------------------------------------------------------------

    def put(self, key: str, payload: object, ranges: Sequence[tuple[int, int]]) -> bool:
        """Store ``payload`` (bytes-like, or a contiguous uint8 array) under ``key``, checksummed
        per range of ``ranges`` ((offset, length) pairs tiling it). Least recently used objects
        not being read are evicted for room. True once the object is stored (or already was);
        False if there is no room, a put or a deletion of ``key`` is under way, or the disk
        failed (counted, logged). Bad arguments raise InvalidArgumentError, nothing written."""
        if not isinstance(key, str):
            raise InvalidArgumentError("key", key, "must be a str")
        try:
            view = memoryview(payload).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError("payload", payload, "must be contiguous bytes") from exc
        if not view:
            raise InvalidArgumentError("payload", payload, "must not be empty")
        header, obj = encode(key, view, check_ranges(ranges, len(view)))
        with self._lock:
            self._check_open()
            if key in self._index:
                self._touch([key])
                return True
            if key in self._busy:
                return False
            victims = self._room_for(obj.size)
            if victims is None:
                return False
            self._busy.add(key)
            self._reserved += obj.size
        self._delete(victims)
        try:
            write_object(self._path(key), header, view)
        except OSError as exc:
            with self._lock:
                self._busy.discard(key)
                self._reserved -= obj.size
                self._io_error("write", exc, key)
            return False
        with self._lock:
            self._busy.discard(key)
            self._reserved -= obj.size
            self._add(key, obj)
            self._counts["writes"] += 1
            self._counts["write_bytes"] += obj.payload
        return True

    def remove(self, key: str) -> bool:
        """Delete ``key``'s object; False if it is not stored or is being read or written."""
        with self._lock:
            self._check_open()
            if key not in self._index or self._readers[key] or key in self._busy:
                return False
            self._drop(key)
            self._busy.add(key)
        self._delete([key])
        return True

    # -- reads ------------------------------------------------------------------------------------

    def read(self, key: str, offset: int, length: int, out: object) -> bool:
        """Read payload bytes ``[offset, offset + length)`` of ``key`` into ``out`` (a writable
        uint8 array or memoryview of ``length`` bytes) and verify every range they cover; the
        span must start and end on range boundaries (InvalidArgumentError). False if ``key`` is
        not stored, or on a checksum mismatch, a short file or an I/O error: then the object
        is dropped and its file deleted (counted, logged). Never True with wrong bytes.
        Reads do not touch: ``lookup`` and ``touch`` keep the order."""
        try:
            view = memoryview(out).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError("out", out, "must be a contiguous buffer") from exc
        if view.readonly or len(view) != length:
            raise InvalidArgumentError("out", out, f"must be writable, of {length} bytes")
        with self._lock:
            self._check_open()
            obj = self._index.get(key)
            if obj is None:
                return False
            covered = obj.covered(offset, length)
            self._readers[key] += 1
        trouble: str | OSError | None = None
        try:
            got = read_into(self._path(key), view, obj.header + offset)
            short = f"{got} of {length} bytes at {offset}: the file is short"
            trouble = short if got < length else mismatch(key, view, offset, covered)
        except FileNotFoundError:
            trouble = "its file is gone"
        except OSError as exc:
            trouble = exc
        with self._lock:
            self._readers[key] -= 1
            if not self._readers[key]:
                del self._readers[key]
            if trouble is None:
                self._counts["reads"] += 1
                self._counts["read_bytes"] += length
                return True
            dropped = self._index.get(key) is obj
            if dropped:
                self._drop(key)
                self._busy.add(key)
            if isinstance(trouble, OSError):
                self._io_error("read", trouble, key)
            else:
                self._counts["corrupt"] += 1
                self._warnings.warn("corrupt", f"dropped {key!r}: {trouble}")
        if dropped:
            self._delete([key])
        return False

    def read_all(self, key: str) -> np.ndarray | None:
        """``key``'s whole payload, verified (None as ``read`` returns False)."""
        with self._lock:
            obj = self._index.get(key)
        if obj is None:
            return None
        out = np.empty(obj.payload, dtype=np.uint8)
        return out if self.read(key, 0, obj.payload, out) else None

    # -- internals ------------------------------------------------------------------------------

    def _recover(self) -> None:
        for path, _, _ in list_files(self._root, TMP):  # torn writes
            unlink_quietly(path)
        found: list[tuple[int, str, ObjectHeader]] = []
        discarded: list[str] = []
        for path, mtime, size in list_files(self._root, SUFFIX):
            try:
                found.append((mtime, *read_header(path, size)))
            except (OSError, ValueError) as exc:
                discarded.append(f"{path}: {exc}")
                unlink_quietly(path)
        for _, key, obj in sorted(found, key=lambda f: f[0]):
            self._add(key, obj)
        self._counts["recovered"] = len(found)
        self._counts["discarded"] = len(discarded)
        if discarded:
            log.warning("disk tier: removed %d invalid files (%s)", len(discarded), discarded[0])
        self._delete(self._room_for(0) or [])  # a capacity smaller than the last run's

    def _room_for(self, size: int) -> list[str] | None:
        """Drop least recently used objects not being read until ``size`` more bytes fit; the
        keys dropped (their files for the caller to delete, marked busy till then), or None
        (nothing dropped) if they cannot be made to fit."""
        over = self._used + self._reserved + size - self.capacity
        victims: list[str] = []
        for key, obj in self._index.items():
            if over <= 0:
                break
            if not self._readers[key]:
                victims.append(key)
                over -= obj.size
        if over > 0:
            return None
        for key in victims:
            self._drop(key)
            self._busy.add(key)
        self._counts["evictions"] += len(victims)
        return victims

    def _delete(self, keys: list[str]) -> None:
        """Delete the files of ``keys`` (dropped from the index, marked busy) and unmark them."""
        for key in keys:
            unlink_quietly(self._path(key))
        if keys:
            with self._lock:
                self._busy.difference_update(keys)

    def _add(self, key: str, obj: ObjectHeader) -> None:
        self._index[key] = obj
        self._used += obj.size

    def _drop(self, key: str) -> None:
        self._used -= self._index.pop(key).size

    def _touch(self, keys: Sequence[str]) -> None:
        for key in reversed(keys):
            if key in self._index:
                self._index.move_to_end(key)

    def _io_error(self, what: str, exc: OSError, key: str) -> None:
        self._counts["io_errors"] += 1
        if exc.errno == errno.ENOSPC:
            self._counts["no_space"] += 1
        kind = f"{what} {errno.errorcode.get(exc.errno or 0, 'error')}"
        self._warnings.warn(kind, f"{what} of {key!r} failed: {exc}")

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the disk tier")

    def _path(self, key: str) -> str:
        return object_path(self._root, key)
