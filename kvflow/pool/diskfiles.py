"""The disk tier's files: their format, and writing, reading and finding them (no state).

An object's file is ``kvflow-disk-v1/objects/<2 hex>/<32 hex>.kvo``, named by the blake2b-128
hash of its key (the first two hex digits are its subdirectory); a directory of another format
(another ``kvflow-disk-v*``) is never read. The file, little-endian::

    0        4  b"KVFD"
    4        2  format version (1)
    6        2  K: the key's length (utf-8 bytes)
    8        4  H: the header's length, where the payload starts (a multiple of 4096, so the
                payload can be read with O_DIRECT)
    12       8  P: the payload's size
    20       4  N: the number of checksum ranges
    24       K  the key
    24+K   20N  the ranges, in order: offset (8), length (8), crc32 (4); they tile the payload
    ...      4  crc32 of the header's bytes before it; zeros up to H
    H        P  the payload

A range's crc32 is that of its bytes started from the crc32 of the key (``zlib.crc32(bytes,
crc32(key))``), so a file put under another key's name fails its checks too. The writer chooses
the ranges (the pool server: ``granules``, 16 KiB each): a reader reads whole ranges and
verifies each one, so reading any span costs at most a range more on either side.

``write_object`` writes ``<32 hex>.tmp`` beside the object, ``fdatasync``s it and renames it
into place, so a kill or a power loss leaves the whole object or none (the directory is not
synced: a rename a power loss takes loses that object only). Leftover ``.tmp`` files are torn
writes. The functions here block for their I/O and share nothing: any thread may call them.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.errors import ConfigError, InvalidArgumentError

__all__ = [
    "FORMAT_DIR",
    "FORMAT_VERSION",
    "GRANULE",
    "HEAD",
    "PAGE",
    "SUFFIX",
    "TMP",
    "ObjectHeader",
    "check_ranges",
    "decode",
    "encode",
    "granules",
    "header_size",
    "list_files",
    "lock_folder",
    "mismatch",
    "object_header",
    "object_name",
    "object_path",
    "open_object",
    "read_header",
    "read_into",
    "unlink_quietly",
    "write_object",
]

FORMAT_VERSION = 1
FORMAT_DIR = f"kvflow-disk-v{FORMAT_VERSION}"
SUFFIX = ".kvo"
TMP = ".tmp"
PAGE = 4096
HEAD = PAGE  # what a reader reads first: the whole header, unless it has very many ranges
GRANULE = 16 << 10  # the pool server's checksum ranges (``granules``)
MAX_KEY = 0xFFFF  # utf-8 bytes
_MAX_HEADER = 1 << 20
_MAGIC = b"KVFD"
_FIXED = struct.Struct("<4sHHIQI")  # magic, version, K, H, P, N
_RANGE = struct.Struct("<QQI")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class ObjectHeader:
    """What a file's header says: where the payload starts, its size and its ranges."""

    size: int  # the file's: header + payload
    header: int  # where the payload starts
    payload: int
    ranges: tuple[tuple[int, int, int], ...]  # (offset, length, crc32), in order

    def covered(self, offset: int, length: int) -> tuple[tuple[int, int, int], ...]:
        """The ranges payload bytes ``[offset, offset + length)`` cover; InvalidArgumentError
        naming ``offset`` or ``length`` if the span does not start or end on a boundary."""
        starts = [r[0] for r in self.ranges]
        first = bisect.bisect_left(starts, offset)
        if isinstance(offset, bool) or first == len(starts) or starts[first] != offset:
            raise InvalidArgumentError("offset", offset, "must start a checksum range")
        last = bisect.bisect_left(starts, offset + length, lo=first) - 1
        if last < first or sum(self.ranges[last][:2]) != offset + length:
            raise InvalidArgumentError("length", length, "must end a checksum range")
        return self.ranges[first : last + 1]

    def spanning(self, offset: int, length: int) -> tuple[int, int]:
        """The whole ranges that payload bytes ``[offset, offset + length)`` touch, as one
        span: (its offset, its length). The bytes must lie inside the payload."""
        starts = [r[0] for r in self.ranges]
        first = bisect.bisect_right(starts, offset) - 1
        last = bisect.bisect_left(starts, offset + length) - 1
        start = self.ranges[first][0]
        return start, sum(self.ranges[last][:2]) - start


def granules(size: int) -> list[tuple[int, int]]:
    """Checksum ranges of GRANULE bytes (the last one shorter) tiling ``size`` bytes."""
    return [(at, min(GRANULE, size - at)) for at in range(0, size, GRANULE)]


def object_name(key: str) -> str:
    """The file name of ``key``'s object, without its suffix (32 hex digits)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def object_path(root: str, key: str) -> str:
    """The path of ``key``'s object file under ``root`` (the ``objects`` folder)."""
    name = object_name(key)
    return os.path.join(root, name[:2], name + SUFFIX)


def check_ranges(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``ranges`` ((offset, length) pairs) sorted, if they tile ``[0, size)``;
    InvalidArgumentError naming ``ranges`` otherwise (outside, overlapping, leaving a gap)."""
    try:
        spans = sorted((int(offset), int(length)) for offset, length in ranges)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError("ranges", ranges, "expected (offset, length) pairs") from exc
    at = 0
    for offset, length in spans:
        if length < 1 or offset < 0 or offset + length > size:
            raise InvalidArgumentError("ranges", (offset, length), f"outside {size} bytes")
        if offset != at:
            why = "overlaps the range before" if offset < at else f"leaves [{at}, {offset}) out"
            raise InvalidArgumentError("ranges", (offset, length), why)
        at = offset + length
    if at != size or not spans:
        raise InvalidArgumentError("ranges", ranges, f"must cover all {size} payload bytes")
    return spans


def encode(
    key: str, payload: memoryview, spans: list[tuple[int, int]]
) -> tuple[bytes, ObjectHeader]:
    """The header (``H`` bytes, padding included) of ``key``'s object holding ``payload`` with
    checksums over ``spans`` (from ``check_ranges``), and what it says."""
    try:
        name = key.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError("key", key, "is not encodable as utf-8") from exc
    if len(name) > MAX_KEY:
        raise InvalidArgumentError("key", key, f"is longer than {MAX_KEY} utf-8 bytes")
    seed = zlib.crc32(name)
    ranges = tuple((o, n, zlib.crc32(payload[o : o + n], seed)) for o, n in spans)
    used = _FIXED.size + len(name) + _RANGE.size * len(ranges) + _CRC.size
    header = -(-used // PAGE) * PAGE
    if header > _MAX_HEADER:
        raise InvalidArgumentError("ranges", len(ranges), "too many for one object's header")
    body = _FIXED.pack(_MAGIC, FORMAT_VERSION, len(name), header, len(payload), len(ranges))
    body += name + b"".join(_RANGE.pack(*r) for r in ranges)
    body += _CRC.pack(zlib.crc32(body))
    return body + bytes(header - len(body)), ObjectHeader(
        header + len(payload), header, len(payload), ranges
    )


def header_size(first: bytes) -> int:
    """How many bytes of the file ``decode`` needs, from its first bytes (at least the fixed
    part's 24); ValueError if they are not this format's."""
    if len(first) < _FIXED.size:
        raise ValueError("shorter than a header")
    magic, version, nkey, header, _, count = _FIXED.unpack_from(first)
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"magic {magic!r}, version {version}: not this format")
    needed: int = _FIXED.size + nkey + _RANGE.size * count + _CRC.size
    if header % PAGE or not needed <= header <= _MAX_HEADER:
        raise ValueError(f"header length {header}")
    return needed


def decode(data: bytes, name: str, size: int) -> tuple[str, ObjectHeader]:
    """The key and header of the file ``name`` (without suffix) of ``size`` bytes, from its
    first ``header_size`` bytes; ValueError says why the file is not a valid object."""
    needed = header_size(data)
    if len(data) < needed:
        raise ValueError("shorter than its header")
    _, _, nkey, header, payload, count = _FIXED.unpack_from(data)
    used = needed - _CRC.size
    if _CRC.unpack_from(data, used)[0] != zlib.crc32(data[:used]):
        raise ValueError("the header's checksum does not match")
    key = data[_FIXED.size : _FIXED.size + nkey].decode()
    if object_name(key) != name:
        raise ValueError(f"holds key {key!r}, whose hash is not the file's name")
    if size != header + payload:
        raise ValueError(f"{size} bytes, the header says {header + payload}")
    at = _FIXED.size + nkey
    ranges = tuple(_RANGE.unpack_from(data, at + i * _RANGE.size) for i in range(count))
    check_ranges([(o, n) for o, n, _ in ranges], payload)
    return key, ObjectHeader(size, header, payload, ranges)


def mismatch(
    key: str, view: memoryview, offset: int, ranges: Sequence[tuple[int, int, int]]
) -> str | None:
    """Which of ``ranges`` the payload bytes in ``view`` (from ``offset``) fail, or None."""
    seed = zlib.crc32(key.encode())
    for start, n, crc in ranges:
        if zlib.crc32(view[start - offset : start - offset + n], seed) != crc:
            return f"the checksum of payload bytes [{start}, {start + n}) does not match"
    return None


# -- the files --------------------------------------------------------------------------------


def write_object(path: str, header: bytes, payload: memoryview) -> None:
    """Write the object file ``path`` whole or not at all; on an OSError its ``.tmp`` file is
    removed and the error raised."""
    tmp = path[: -len(SUFFIX)] + TMP
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            parts = [memoryview(header), payload]
            while parts:
                n = os.writev(fd, parts)
                while parts and n >= len(parts[0]):
                    n -= len(parts.pop(0))
                if parts and n:
                    parts[0] = parts[0][n:]
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError:
        unlink_quietly(tmp)
        raise


def read_into(path: str, view: memoryview, at: int) -> int:
    """Read ``path`` from byte ``at`` into ``view``; how many bytes came (fewer: the file
    ended). OSError (FileNotFoundError among them) is raised."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], at + got)
            if n == 0:
                break
            got += n
        return got
    finally:
        os.close(fd)


def read_header(path: str, size: int) -> tuple[str, ObjectHeader]:
    """The key and header of the object file ``path`` of ``size`` bytes (``decode``)."""
    name = os.path.basename(path)[: -len(SUFFIX)]
    if os.path.basename(os.path.dirname(path)) != name[:2]:
        raise ValueError("in another name's folder")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return decode(_head(fd), name, size)
    finally:
        os.close(fd)


def _head(fd: int) -> bytes:
    """The first bytes of an object file, as many as ``decode`` needs."""
    first = os.pread(fd, HEAD, 0)
    needed = header_size(first)
    return first if needed <= len(first) else os.pread(fd, needed, 0)


def object_header(fd: int, path: str, key: str) -> ObjectHeader:
    """The header of the object file ``path``, open as ``fd``, which must hold ``key``.
    ValueError if the file is not a valid object of ``key``; OSError."""
    found, header = decode(_head(fd), os.path.basename(path)[: -len(SUFFIX)], os.fstat(fd).st_size)
    if found != key:
        raise ValueError(f"the file holds {found!r}, not {key!r}")
    return header


def open_object(path: str, key: str) -> tuple[int, ObjectHeader]:
    """Open the object file ``path`` of ``key`` for reading: its descriptor (the caller closes
    it) and header (``object_header``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fd, object_header(fd, path, key)
    except BaseException:
        os.close(fd)
        raise


def lock_folder(path: str, directory: str | os.PathLike[str]) -> int:
    """An exclusive lock on ``path`` (its descriptor), or ConfigError naming ``disk_dir``:
    two pools writing one folder would delete each other's files."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError("disk_dir", directory, "is in use by another pool") from None
    return fd


def list_files(root: str, suffix: str) -> list[tuple[str, int, int]]:
    """(path, mtime in ns, size) of the files ending in ``suffix`` in ``root``'s folders."""
    found = []
    for sub in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        folder = os.path.join(root, sub)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if name.endswith(suffix):
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(os.path.join(folder, name))
                    found.append((os.path.join(folder, name), st.st_mtime_ns, st.st_size))
    return found


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it can be removed (a file already gone or not removable stays so)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
