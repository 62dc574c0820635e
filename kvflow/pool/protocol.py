"""The shared pool's wire protocol: compact, versioned binary frames over a Unix socket.

Every message, either way, is one frame::

    header  <I B B H I>   body length, protocol version, op (request) or code (reply), flags,
                          request id
    body    op-specific, little-endian, every length checked against what is left

``flags`` is 0 but in the reply to HELLO, where it names what the server understands beyond
the first ops (``Feature``): a client sends an op that needs a feature only to a server that
named it, so clients and servers of different releases of protocol version 1 work together.

Requests (and their reply bodies):

    HELLO         u32 pid                      -> u64 capacity, u64 instance, u32 lease_ttl_ms
                                                  (+ the arena's file descriptor, SCM_RIGHTS)
    LOOKUP        keys                         -> u32 n, n x u8 found
    OPEN_WRITE    u64 nbytes, keys             -> session (flags: WriteStatus)
    FINISH_WRITE  u64 handle, u32 n, n x u8 ok -> (empty)
    OPEN_READ     keys                         -> session (flags: found)
    CLOSE_READ    u64 handle                   -> (empty)
    STATS         (empty)                      -> u32 n, n x u64 (STATS_FIELDS, in order)
    BYE           (empty)                      -> (empty); the connection's sessions are
                                                  released before the reply, then it closes
    LOOKUP_CTX    keys, context keys           -> as LOOKUP       (Feature.CONTEXT)
    OPEN_WRITE_CTX  u64 nbytes, keys, context keys -> as OPEN_WRITE (Feature.CONTEXT)
    OPEN_READ_CTX keys, context keys           -> as OPEN_READ    (Feature.CONTEXT)
    DISK          (empty)                      -> UTF-8 folder of the disk tier's objects
                                                  (Feature.DISK; empty: not for this client)
    DISK_DROP     keys                         -> (empty); their disk objects failed a client's
                                                  checks: the server deletes them (Feature.DISK)

A client that asked DISK and got a folder sees the disk tier from then on: LOOKUP finds its
objects too, and OPEN_READ answers flag 2 for a key whose object is on disk only (offset 0,
its payload's size; no lease: the client reads the file itself, ``kvflow.pool.diskfiles``).

The ``_CTX`` ops also name the chunks before their keys (the prefix context of
``kvflow.stores.base``): the server only touches those for its eviction order, after the call's
own keys.

A session reply is ``u64 handle, u32 n, n x i64 offset, n x i64 size, n x u8 flag``.
``keys`` is ``u32 n, n x u16 length, the UTF-8 bytes of every key back to back``. A reply's code
says how the request went (``Code``); a reply with a code other than OK has an empty body or a
UTF-8 reason. A connection the server does not take (its connection limit, a uid it does not
accept) gets a REFUSED reply to its HELLO, with the reason, and is closed. Decoding is pure
and all-or-nothing: a message is decoded completely before the server acts on it, so a
malformed one (``ProtocolError``) changes nothing.

Both sides read frames with ``read_frame`` (over ``recv_exact``): blocking reads on one socket,
from one thread at a time; a body's fields are read with ``kvflow.pool.codec.Reader``.
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvflow.errors import ProtocolError
from kvflow.pool.codec import MAX_KEY_BYTES, MAX_KEYS, U32, U64, Reader, encode_keys

__all__ = [
    "HEADER",
    "MAX_BODY",
    "MAX_KEYS",
    "MAX_KEY_BYTES",
    "STATS_FIELDS",
    "VERSION",
    "FEATURES",
    "Code",
    "Feature",
    "Frame",
    "Hello",
    "Op",
    "Request",
    "decode_request",
    "encode_keys",
    "frame",
    "read_frame",
    "recv_exact",
    "Reader",
    "finish_write_body",
    "flags_reply",
    "handle_body",
    "hello_body",
    "hello_reply",
    "keys_context_body",
    "open_write_body",
    "open_write_context_body",
    "parse_flags",
    "parse_hello",
    "parse_session",
    "parse_stats",
    "session_reply",
    "stats_reply",
]

VERSION = 1
HEADER = struct.Struct("<IBBHI")
MAX_BODY = 64 << 20  # a frame's body; 1 M keys of 64 bytes fit

STATS_FIELDS = (
    "capacity",
    "used",
    "objects",
    "pending_writes",
    "leases",
    "open_sessions",
    "hits",
    "misses",
    "evictions",
    "no_space",
    "expired_leases",
    "clients",
    "clients_total",
    "released_on_disconnect",
    "refused_peers",
    "bad_messages",
    "requests",
    "refused_limit",
    "idle_closed",
    "max_clients",
    "idle_timeout_ms",
    "disk_capacity",
    "disk_used",
    "disk_objects",
    "disk_hits",
    "disk_reads_served",
    "demotions",
    "demotion_bytes",
    "demotions_skipped",
    "promotions",
    "promotion_bytes",
    "promotions_failed",
    "disk_evictions",
    "disk_io_errors",
    "disk_no_space",
    "disk_corrupt",
    "disk_recovered",
    "disk_dropped_by_clients",
    "disk_queued",
)  # new fields go last: a client reads as many as it knows


class Op(enum.IntEnum):
    HELLO = 1
    LOOKUP = 2
    OPEN_WRITE = 3
    FINISH_WRITE = 4
    OPEN_READ = 5
    CLOSE_READ = 6
    STATS = 7
    BYE = 8
    LOOKUP_CTX = 9  # Feature.CONTEXT
    OPEN_WRITE_CTX = 10
    OPEN_READ_CTX = 11
    DISK = 12  # Feature.DISK
    DISK_DROP = 13


class Feature(enum.IntFlag):
    """What a server understands beyond the first ops; named in its HELLO reply's flags."""

    CONTEXT = 1  # the _CTX ops
    DISK = 2  # a disk tier, read by clients that ask DISK


FEATURES = Feature.CONTEXT  # this server's (Feature.DISK too where it has a disk tier)
ON_DISK = 2  # OPEN_READ's flag for a key on disk only


class Code(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1  # malformed: the server closes the connection after this reply
    UNKNOWN_SESSION = 2  # no such session on this connection (never opened, or finished)
    EXPIRED = 3  # the read session's leases ran past the server's time limit
    VERSION_MISMATCH = 4
    INVALID_ARGUMENT = 5
    REFUSED = 6  # to a HELLO: the connection is not taken (the body says why); it closes


@dataclass(frozen=True)
class Request:
    """A decoded request. Fields unused by ``op`` keep their defaults."""

    op: Op
    keys: tuple[str, ...] = ()
    nbytes: int = 0
    handle: int = 0
    flags: np.ndarray | None = None  # FINISH_WRITE's ok flags
    pid: int = 0
    context: tuple[str, ...] = ()  # the _CTX ops' context keys


@dataclass(frozen=True)
class Hello:
    """The server's answer to HELLO."""

    capacity: int
    instance: int
    lease_ttl_ms: int


_HELLO = struct.Struct("<QQI")
_HANDLE_N = struct.Struct("<QI")


def frame(code_or_op: int, request_id: int, body: bytes = b"", flags: int = 0) -> bytes:
    """One frame: header plus body."""
    return HEADER.pack(len(body), VERSION, code_or_op, flags, request_id) + body


class Frame(NamedTuple):
    """A frame read: its header's fields and its body (``kind``: the op or the reply code)."""

    version: int
    kind: int
    flags: int
    request_id: int
    body: bytes


def recv_exact(sock: socket.socket, n: int, timeout: float | None = None) -> bytes:
    """``n`` bytes from ``sock``, or fewer if the peer closes first (none: closed before them).

    ``timeout``: all ``n`` bytes must arrive within this long, else TimeoutError; None leaves
    each wait to the socket's own timeout. The socket's errors (OSError) propagate.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    while got < n:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        k = sock.recv_into(view[got:])
        if k == 0:
            return bytes(view[:got])
        got += k
    return bytes(buf)


def read_frame(
    sock: socket.socket, timeout: float | None = None, head: bytes = b""
) -> Frame | None:
    """The next frame on ``sock``; None if the peer closed before its first byte.

    ``head``: the header's first bytes, already received (with a file descriptor, say).
    ``timeout`` bounds the header and the body each (``recv_exact``). A peer that closes inside
    the frame raises EOFError; a body over MAX_BODY, ProtocolError. A frame of another protocol
    version is returned with its header only (an empty body, left unread): the caller refuses it.
    """
    header = head + recv_exact(sock, HEADER.size - len(head), timeout)
    if not header:
        return None
    if len(header) < HEADER.size:
        raise EOFError(f"connection closed after {len(header)} of {HEADER.size} header bytes")
    length, version, kind, flags, rid = HEADER.unpack(header)
    if version != VERSION:
        return Frame(version, kind, flags, rid, b"")
    if length > MAX_BODY:
        raise ProtocolError(f"a {length}-byte message (limit {MAX_BODY})")
    body = recv_exact(sock, length, timeout)
    if len(body) < length:
        raise EOFError(f"connection closed after {len(body)} of {length} body bytes")
    return Frame(version, kind, flags, rid, body)


def decode_request(op: int, body: bytes) -> Request:
    """Decode one request body. Raises ProtocolError for anything malformed."""
    try:
        kind = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    r = Reader(body)
    if kind == Op.HELLO:
        req = Request(kind, pid=r.u32("pid"))
    elif kind in (Op.LOOKUP, Op.OPEN_READ, Op.DISK_DROP):
        req = Request(kind, keys=r.keys())
    elif kind in (Op.LOOKUP_CTX, Op.OPEN_READ_CTX):
        req = Request(kind, keys=r.keys(), context=r.keys())
    elif kind in (Op.OPEN_WRITE, Op.OPEN_WRITE_CTX):
        nbytes = r.u64("nbytes")
        if nbytes < 1 or nbytes >= 1 << 62:
            raise ProtocolError(f"object size {nbytes} out of range")
        keys = r.keys()
        context = r.keys() if kind == Op.OPEN_WRITE_CTX else ()
        req = Request(kind, nbytes=nbytes, keys=keys, context=context)
    elif kind == Op.FINISH_WRITE:
        handle = r.u64("handle")
        n = r.u32("flag count")
        if n > MAX_KEYS:
            raise ProtocolError(f"flag count {n} above the limit {MAX_KEYS}")
        flags = r.array(np.uint8, n, "ok flags")
        if n and int(flags.max()) > 1:
            raise ProtocolError("ok flags must be 0 or 1")
        req = Request(kind, handle=handle, flags=flags.astype(bool))
    elif kind == Op.CLOSE_READ:
        req = Request(kind, handle=r.u64("handle"))
    else:
        req = Request(kind)
    r.end()
    return req


# -- bodies: one encoder per request, one decoder per reply (used by the client) --------------


def hello_body(pid: int) -> bytes:
    return U32.pack(pid & 0xFFFFFFFF)


def hello_reply(hello: Hello) -> bytes:
    return _HELLO.pack(hello.capacity, hello.instance, hello.lease_ttl_ms)


def parse_hello(body: bytes) -> Hello:
    r = Reader(body)
    capacity, instance, ttl = _HELLO.unpack(r.take(_HELLO.size, "hello"))
    r.end()
    return Hello(capacity, instance, ttl)


def open_write_body(keys: tuple[str, ...], nbytes: int) -> bytes:
    return U64.pack(nbytes) + encode_keys(keys)


def open_write_context_body(keys: tuple[str, ...], nbytes: int, context: tuple[str, ...]) -> bytes:
    return open_write_body(keys, nbytes) + encode_keys(context)


def keys_context_body(keys: tuple[str, ...], context: tuple[str, ...]) -> bytes:
    """The body of LOOKUP_CTX and OPEN_READ_CTX."""
    return encode_keys(keys) + encode_keys(context)


def finish_write_body(handle: int, ok: np.ndarray) -> bytes:
    return _HANDLE_N.pack(handle, len(ok)) + np.asarray(ok, dtype=np.uint8).tobytes()


def handle_body(handle: int) -> bytes:
    return U64.pack(handle)


def flags_reply(found: np.ndarray) -> bytes:
    return U32.pack(len(found)) + np.asarray(found, dtype=np.uint8).tobytes()


def parse_flags(body: bytes, n: int) -> np.ndarray:
    r = Reader(body)
    if r.u32("count") != n:
        raise ProtocolError(f"reply for a different number of keys (expected {n})")
    out = r.array(np.uint8, n, "flags")
    r.end()
    return out


def session_reply(handle: int, offsets: np.ndarray, sizes: np.ndarray, flags: np.ndarray) -> bytes:
    n = len(offsets)
    return (
        _HANDLE_N.pack(handle, n)
        + np.asarray(offsets, dtype="<i8").tobytes()
        + np.asarray(sizes, dtype="<i8").tobytes()
        + np.asarray(flags, dtype=np.uint8).tobytes()
    )


def parse_session(body: bytes, n: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(handle, offsets, sizes, flags) of a session reply for ``n`` keys."""
    r = Reader(body)
    handle, count = _HANDLE_N.unpack(r.take(_HANDLE_N.size, "session"))
    if count != n:
        raise ProtocolError(f"reply for {count} keys, expected {n}")
    offsets = r.array(np.dtype("<i8").type, n, "offsets").astype(np.int64)
    sizes = r.array(np.dtype("<i8").type, n, "sizes").astype(np.int64)
    flags = r.array(np.uint8, n, "flags")
    r.end()
    return int(handle), offsets, sizes, flags


def stats_reply(values: dict[str, int]) -> bytes:
    nums = np.array([values[name] for name in STATS_FIELDS], dtype="<u8")
    return U32.pack(len(nums)) + nums.tobytes()


def parse_stats(body: bytes) -> dict[str, int]:
    r = Reader(body)
    n = r.u32("count")
    if n > 4096:
        raise ProtocolError(f"{n} stats fields")
    nums = r.array(np.dtype("<u8").type, n, "stats")
    r.end()
    return {name: int(v) for name, v in zip(STATS_FIELDS, nums.tolist(), strict=False)}
