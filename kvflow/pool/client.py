"""PoolConnection: one client connection to a pool server, with the arena mapped.

Blocking and not thread-safe: the owner (a SharedStore's PoolLink) serialises requests. Every
read and write on the socket has a timeout; a timeout, a closed socket or a malformed reply raises
StoreUnavailableError or ProtocolError, after which the connection is unusable (``broken``;
``hung_up`` when the server had closed it). A server that does not take the connection (its
connection limit) says why: PoolRefusedError.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import socket
import stat
import struct
from collections.abc import Callable

from kvflow.copying.cuda import pin_host
from kvflow.errors import PoolRefusedError, ProtocolError, StoreError, StoreUnavailableError
from kvflow.pool import protocol as p
from kvflow.pool.memory import SEALS, map_shared, reserve, unmap

__all__ = ["PoolConnection", "Reply", "map_shared", "query_stats", "unmap"]

_PEERCRED = struct.Struct("3i")

Reply = tuple[p.Code, bytes]


class PoolConnection:
    """Connect to ``path``, check who serves it, say HELLO, receive and map the arena
    (``base``, ``capacity``).

    The server must run as this process's uid (or one of ``trusted_uids``), and the socket's
    directory must belong to it and be writable by nobody else: a pool another user planted
    on the path is refused (StoreUnavailableError), never written to or read from.

    ``reuse``: a closed connection whose mapping no session refers to any more. If the server
    is the same one (its instance and capacity), this connection takes that mapping over, pin
    included, instead of mapping (and pinning) the arena again; else it is left as it was.
    """

    def __init__(
        self,
        path: str,
        timeout_s: float,
        *,
        populate: bool = False,
        trusted_uids: tuple[int, ...] = (),
        pin: bool | None = False,
        reuse: PoolConnection | None = None,
    ) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.broken = False
        self.hung_up = False
        self.base = 0
        self.capacity = 0
        self.retired = False
        self.pinned = False
        self.features = 0  # what the server understands beyond the first ops (protocol.Feature)
        self.disk_root = ""  # the disk tier's folder, where this client may read it (DISK)
        self._unpin: Callable[[], None] | None = None
        self._next_id = 1
        _check_directory(path, trusted_uids)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise StoreUnavailableError(f"no kvflow pool server on {path}: {exc}") from exc
        self._sock = sock
        try:
            _check_peer(sock, path, trusted_uids)
            self.hello = self._greet(populate, reuse)
            if self.features & p.Feature.DISK:
                code, root = self.request(p.Op.DISK)
                if code == p.Code.OK:
                    self.disk_root = root.decode("utf-8", "replace")
            if self._unpin is None:  # a mapping taken over (``reuse``) keeps its pin
                self._unpin = pin_host(self.base, self.capacity, pin)
                self.pinned = self._unpin is not None
        except BaseException:
            self.close()
            self.unmap()
            raise

    def _greet(self, populate: bool, reuse: PoolConnection | None) -> p.Hello:
        rid = self._send(p.Op.HELLO, p.hello_body(os.getpid()))
        try:
            header, fds, _, _ = socket.recv_fds(self._sock, p.HEADER.size, 1)
        except OSError as exc:
            raise StoreUnavailableError(
                f"pool server on {self.path} did not answer: {exc}"
            ) from exc
        try:
            code, body, features = self._read_reply(rid, header)
            if code == p.Code.REFUSED:
                raise PoolRefusedError(self.path, body.decode("utf-8", "replace"))
            if code != p.Code.OK:
                raise StoreError(f"pool server refused HELLO: {body.decode('utf-8', 'replace')}")
            hello = p.parse_hello(body)
            self.features = features  # the HELLO reply's flags
            if len(fds) != 1:
                raise ProtocolError("HELLO reply came without the arena")
            size = os.fstat(fds[0]).st_size
            seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
            if seals & SEALS != SEALS:
                raise ProtocolError("the arena is not sealed against resizing")
            if size != hello.capacity:
                raise ProtocolError(f"arena of {size} bytes, server said {hello.capacity}")
            if not self._take_mapping(reuse, hello):
                self.base = map_shared(fds[0], size, populate)
            self.capacity = size
        finally:
            for fd in fds:
                os.close(fd)
        return hello

    def _take_mapping(self, old: PoolConnection | None, hello: p.Hello) -> bool:
        """Take ``old``'s mapping if it maps this very arena (same server instance)."""
        if old is None or not old.base or old.retired or not old.broken:
            return False
        if (old.hello.instance, old.capacity) != (hello.instance, hello.capacity):
            return False
        self.base, self._unpin, self.pinned = old.base, old._unpin, old.pinned
        old.base, old._unpin, old.pinned = 0, None, False
        return True

    # -- requests -----------------------------------------------------------------------------

    def request(self, op: p.Op, body: bytes = b"") -> Reply:
        """Send one request and return its reply's code and body."""
        if self.broken:
            raise StoreUnavailableError(f"connection to the pool on {self.path} is closed")
        try:
            rid = self._send(op, body)
            code, reply, _ = self._read_reply(rid)
            return code, reply
        except BaseException:
            self.broken = True
            raise

    def peer_gone(self) -> bool:
        """True if the server closed its end (a poll, no wait; safe beside a request)."""
        if self.broken:
            return True
        poller = select.poll()  # one per call: a poll object is not thread-safe
        poller.register(self._sock.fileno(), 0)  # HUP and ERR are always reported
        return bool(poller.poll(0))

    def _send(self, op: p.Op, body: bytes) -> int:
        rid = self._next_id
        self._next_id = (rid + 1) & 0xFFFFFFFF
        try:
            self._sock.sendall(p.frame(op, rid, body))
        except OSError as exc:
            self.hung_up = isinstance(exc, (BrokenPipeError, ConnectionResetError))
            raise StoreUnavailableError(f"pool server on {self.path} is gone: {exc}") from exc
        return rid

    def _read_reply(self, rid: int, head: bytes = b"") -> tuple[p.Code, bytes, int]:
        """The reply to request ``rid`` (``head``: its first bytes, if some came already):
        its code, body and header flags. The header and the body each get ``timeout_s``."""
        try:
            frame = p.read_frame(self._sock, self.timeout_s, head)
            if frame is None:
                raise EOFError("closed before the reply")
        except EOFError:
            self.hung_up = True
            raise StoreUnavailableError(
                f"pool server on {self.path} closed the connection"
            ) from None
        except TimeoutError as exc:
            raise StoreUnavailableError(
                f"pool server on {self.path} did not answer within {self.timeout_s:g} s"
            ) from exc
        except OSError as exc:
            self.hung_up = isinstance(exc, ConnectionResetError)
            raise StoreUnavailableError(f"pool server on {self.path} is gone: {exc}") from exc
        version, got = frame.version, frame.request_id
        if version != p.VERSION or got != rid:
            raise ProtocolError(f"unexpected reply (version {version}, id {got})")
        try:
            return p.Code(frame.kind), frame.body, frame.flags
        except ValueError:
            raise ProtocolError(f"unknown reply code {frame.kind}") from None

    def goodbye(self) -> None:
        """Ask the server to release this connection's sessions now, then close."""
        if not self.broken:
            with contextlib.suppress(StoreError):
                self.request(p.Op.BYE)
        self.close()

    def close(self) -> None:
        """Close the socket (the server then releases this connection's sessions). The arena
        stays mapped: ``unmap()`` it once no copy can touch it."""
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def retire(self) -> None:
        """Give the arena's memory back but keep its address range reserved (no access), so
        no later mapping can land where stale addresses point. ``unmap()`` frees the range."""
        self._release_pin()
        if self.base and not self.retired:
            reserve(self.base, self.capacity)
            self.retired = True

    def unmap(self) -> None:
        self._release_pin()
        if self.base:
            unmap(self.base, self.capacity)
            self.base = 0

    def _release_pin(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None


def query_stats(path: str, timeout_s: float) -> dict[str, int]:
    """The counters of the server on ``path``, over a connection of their own."""
    conn = PoolConnection(path, timeout_s)
    try:
        code, body = conn.request(p.Op.STATS)
    finally:
        conn.goodbye()
        conn.unmap()
    if code != p.Code.OK:
        raise StoreError(f"stats: pool replied {code.name}", int(code))
    return p.parse_stats(body)


def _check_directory(path: str, trusted: tuple[int, ...]) -> None:
    """The socket's directory must be the server's own: owned by us (or a trusted uid) and
    writable by nobody else. Checked without creating anything."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        info = os.lstat(directory)
    except OSError as exc:
        raise StoreUnavailableError(f"no kvflow pool server on {path}: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode) or (
        info.st_uid != os.getuid() and info.st_uid not in trusted
    ):
        raise StoreUnavailableError(
            f"refusing the pool on {path}: its directory belongs to uid {info.st_uid}"
        )
    if info.st_mode & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        raise StoreUnavailableError(f"refusing the pool on {path}: its directory is mode {mode:o}")


def _check_peer(sock: socket.socket, path: str, trusted: tuple[int, ...]) -> None:
    _, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    if uid != os.getuid() and uid not in trusted:
        raise StoreUnavailableError(f"refusing the pool on {path}: its server runs as uid {uid}")
