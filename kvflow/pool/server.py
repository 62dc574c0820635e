"""PoolServer: the node-local pool. It owns the arena and its index; clients copy the bytes.

The arena is a memfd (mode 0600, never a named file) sealed against resizing, whose memory is
allocated and cleared at start, so a client's copy can never fault on a full tmpfs and no
client can shrink it under the others. Clients receive
its file descriptor once, in the HELLO reply (SCM_RIGHTS), map it, and from then on send only
metadata: lookup, open for write or read, commit or abort, release.

Semantics are those of LocalStore (``ArenaIndex``: two-phase writes, read leases, LRU eviction of
committed, unleased objects, a prefix's tail before its head, context keys included: the
``_CTX`` ops), plus ownership: every session belongs to the connection that
opened it and is released when that connection closes, for whatever reason (close, crash,
SIGKILL). Read leases also expire after ``lease_ttl_s``; a client that later closes such a
session is told EXPIRED. Pending writes never expire while their client lives: their slots may
still be being written.

Connections: at most ``max_clients`` at once. One more is refused with a reply that says why
(``Code.REFUSED`` to its HELLO), counted in ``refused_limit``. A connection that holds no session
and sends nothing for ``idle_timeout_s`` is closed (``idle_closed``), so idle or stuck peers
cannot lock clients out; a SharedStore reconnects on its next call without failing it.

Concurrency: one thread accepts, one thread serves each connection (blocking reads of one frame
at a time), one thread expires leases; the index is guarded by one lock, held while a request
is applied (microseconds per key). ``stop()`` is idempotent and may be called from any thread
or a signal handler's thread; connections accepted while it runs are refused. A malformed or
oversized message, or a peer of another uid, closes that connection only, with a logged reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow import trace
from kvflow.config import _positive_float, from_dict, parse_size
from kvflow.errors import (
    ConfigError,
    InvalidArgumentError,
    PoolRunningError,
    ProtocolError,
    StoreError,
)
from kvflow.pool import protocol as p
from kvflow.pool.client import map_shared, unmap
from kvflow.pool.paths import check_socket_path, default_socket, ensure_private_directory, sibling
from kvflow.stores.arena import SLOT_ALIGN, ArenaIndex
from kvflow.stores.base import WriteStatus
from kvflow.stores.hostmem import check_capacity

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_MAX_CLIENTS",
    "PoolConfig",
    "PoolServer",
]

log = logging.getLogger("kvflow.pool")

DEFAULT_CAPACITY = "1GiB"
DEFAULT_LEASE_TTL_S = 300.0
DEFAULT_MAX_CLIENTS = 256
DEFAULT_IDLE_TIMEOUT_S = 60.0
_BODY_TIMEOUT_S = 10.0  # once a header arrived, its body must follow within this
_REFUSE_WAIT_S = 1.0  # a refused peer's HELLO is awaited this long, to answer it
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class PoolConfig:
    """How a pool server is set up.

    Fields:
        socket: the Unix socket path (default: ``kvflow.pool.paths.default_socket()``).
        capacity: arena bytes (accepts "8GiB"); allocated at start.
        lease_ttl_s: a read lease is released after this long even if its client lives on.
            It must exceed the longest load; it only guards against clients that leak leases.
        allow_uids: peers of these uids are accepted besides the server's own uid.
        socket_mode: permission bits of the socket file.
        max_clients: connections served at once; more are refused with a reply saying so.
        idle_timeout_s: a connection that holds no session (no pending write, no read lease)
            and sends nothing for this long is closed, so that idle or stuck peers cannot keep
            others out. A SharedStore reconnects on its next call, without failing it.
    """

    socket: str = ""
    capacity: int | str = DEFAULT_CAPACITY
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    allow_uids: tuple[int, ...] = ()
    socket_mode: int = 0o600
    max_clients: int = DEFAULT_MAX_CLIENTS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "socket", check_socket_path(self.socket or default_socket()))
        size = parse_size(self.capacity, argument="capacity")
        if size < SLOT_ALIGN:
            raise ConfigError("capacity", self.capacity, f"must be at least {SLOT_ALIGN} bytes")
        object.__setattr__(self, "capacity", size)
        _positive_float("lease_ttl_s", self.lease_ttl_s)
        _positive_float("idle_timeout_s", self.idle_timeout_s)
        uids = tuple(self.allow_uids)
        if any(isinstance(u, bool) or not isinstance(u, int) or u < 0 for u in uids):
            raise ConfigError("allow_uids", self.allow_uids, "must be user ids (integers >= 0)")
        object.__setattr__(self, "allow_uids", uids)
        mode = self.socket_mode
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 < mode <= 0o777:
            raise ConfigError("socket_mode", mode, "must be permission bits such as 0o600")
        mc = self.max_clients
        if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
            raise ConfigError("max_clients", mc, "must be an integer >= 1")

    @property
    def size(self) -> int:
        return int(self.capacity)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PoolConfig:
        """Build from a plain dict; unknown keys are an error that lists the known ones."""
        return from_dict(cls, values)


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    pid: int
    uid: int
    sessions: set[int] = field(default_factory=set)  # handles this connection opened
    expired: set[int] = field(default_factory=set)  # its read sessions the reaper released


class PoolServer:
    """Serve one arena on ``config.socket``. ``start()`` returns once clients can connect.

    Raises PoolRunningError if another server holds the socket path, ConfigError (before
    anything is created) if the capacity exceeds the memory available (``kvflow.stores.hostmem``).
    ``stop()`` closes every connection, removes the socket and frees the arena (clients that
    mapped it keep their mapping until they notice and reconnect).
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self.instance = secrets.randbits(63)
        self._index = ArenaIndex(self.config.size)
        self._lock = threading.Lock()
        self._clients: set[_Client] = set()
        self._deadlines: dict[int, float] = {}  # read handle -> monotonic expiry
        self._owner: dict[int, _Client] = {}  # read handle -> its connection
        self._counters = dict.fromkeys(
            ("expired_leases", "clients_total", "released_on_disconnect", "refused_peers"), 0
        )
        self._counters.update(bad_messages=0, requests=0, refused_limit=0, idle_closed=0)
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._lock_fd = -1
        self._arena_fd = -1

    @property
    def socket_path(self) -> str:
        return self.config.socket

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        path = self.config.socket
        check_capacity(self.config.size, self.config.size)  # before any file or memory
        ensure_private_directory(os.path.dirname(path))
        self._lock_fd = _take_lock(sibling(path, ".lock"))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        try:
            self._arena_fd = _make_arena(self.config.size)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead server's socket: we hold the lock, so it is stale
            old = os.umask(0o177)
            try:
                listener.bind(path)
                bound = True
            finally:
                os.umask(old)
            os.chmod(path, self.config.socket_mode)
            listener.listen(128)
            _write_private(sibling(path, ".pid"), f"{os.getpid()}\n")
        except BaseException:
            listener.close()
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self._release_files()
            raise
        self._listener = listener
        self._spawn(self._accept_loop, "kvflow-pool-accept")
        self._spawn(self._reap_loop, "kvflow-pool-leases")
        log.info(
            "kvflow pool: serving %d bytes on %s (lease limit %g s, %d clients at most, "
            "idle connections closed after %g s)",
            self.config.size,
            path,
            self.config.lease_ttl_s,
            self.config.max_clients,
            self.config.idle_timeout_s,
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``stop()``; True if stopped."""
        return self._stopped.wait(timeout)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(OSError):
                client.sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._release_files()
        log.info("kvflow pool: stopped")

    def __enter__(self) -> PoolServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, int]:
        """Every STATS field. Holds _lock."""
        u = self._index.usage()
        values = {name: getattr(u, name) for name in p.STATS_FIELDS if hasattr(u, name)}
        values.update(self._counters, clients=len(self._clients))
        values.update(
            max_clients=self.config.max_clients,
            idle_timeout_ms=round(self.config.idle_timeout_s * 1000),
        )
        return values

    # -- threads ------------------------------------------------------------------------------

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                time.sleep(0.01)  # e.g. EMFILE: do not spin
                continue
            self._spawn(self._serve, "kvflow-pool-client", sock)

    def _reap_loop(self) -> None:
        interval = min(1.0, self.config.lease_ttl_s / 4)
        while not self._stopped.wait(interval):
            now = time.monotonic()
            with self._lock:
                for handle in [h for h, t in self._deadlines.items() if t <= now]:
                    client = self._owner.pop(handle)
                    del self._deadlines[handle]
                    self._index.close_read(handle)
                    client.sessions.discard(handle)
                    client.expired.add(handle)
                    self._counters["expired_leases"] += 1
                    log.warning(
                        "kvflow pool: a lease of client pid %d ran past %g s and was released",
                        client.pid,
                        self.config.lease_ttl_s,
                    )

    def _serve(self, sock: socket.socket) -> None:
        client, refusal = self._admit(sock)
        if client is None:
            if refusal:
                _refuse(sock, refusal)
            sock.close()
            return
        try:
            self._converse(client)
        except ProtocolError as exc:  # every malformed message ends here, counted once
            self._bad()
            log.warning("kvflow pool: closing client pid %d: %s", client.pid, exc)
        except OSError as exc:
            if not self._stopped.is_set():
                log.warning("kvflow pool: closing client pid %d: %s", client.pid, exc)
        except Exception:  # a bug must cost this connection only, never the server
            log.exception("kvflow pool: internal error serving pid %d; closing it", client.pid)
        finally:
            self._disconnect(client)

    def _admit(self, sock: socket.socket) -> tuple[_Client | None, str]:
        """The new connection's client, or None and the reason to tell it (empty: none)."""
        try:
            pid, uid, _ = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
        except OSError as exc:
            log.warning("kvflow pool: refusing a peer without credentials: %s", exc)
            return None, ""
        with self._lock:
            if self._stopped.is_set():
                return None, "the pool server is stopping"
            if uid != os.getuid() and uid not in self.config.allow_uids:
                self._counters["refused_peers"] += 1
                log.warning("kvflow pool: refusing pid %d of uid %d (not allowed)", pid, uid)
                return None, f"uid {uid} is not allowed (kvflow serve --allow-uid)"
            limit = self.config.max_clients
            if len(self._clients) >= limit:
                self._counters["refused_limit"] += 1
                log.warning("kvflow pool: refusing pid %d: %d clients already", pid, limit)
                return None, (
                    f"it serves its limit of {limit} connections (kvflow serve --max-clients); "
                    f"idle ones close after {self.config.idle_timeout_s:g} s, try again then"
                )
            client = _Client(sock, pid, uid)
            self._clients.add(client)
            self._counters["clients_total"] += 1
        return client, ""

    def _disconnect(self, client: _Client) -> None:
        self._release_sessions(client)
        with self._lock:
            self._clients.discard(client)
        client.sock.close()

    def _release_sessions(self, client: _Client) -> None:
        with self._lock:
            released = len(client.sessions)
            for handle in client.sessions:
                self._end_session(handle)
            client.sessions.clear()
            self._counters["released_on_disconnect"] += released
        if released:
            log.info("kvflow pool: client pid %d left; %d sessions released", client.pid, released)

    def _end_session(self, handle: int) -> None:
        if handle in self._deadlines:
            del self._deadlines[handle]
            del self._owner[handle]
            self._index.close_read(handle)
        else:
            self._index.finish_write(handle, np.zeros(0, dtype=bool))

    # -- one connection -----------------------------------------------------------------------

    def _converse(self, client: _Client) -> None:
        sock = client.sock
        greeted = False
        while True:
            if not self._await_request(client):
                return
            sock.settimeout(_BODY_TIMEOUT_S)
            header = _recv_exact(sock, p.HEADER.size)
            if header is None:
                return
            length, version, op, _, rid = p.HEADER.unpack(header)
            if version != p.VERSION:
                sock.sendall(
                    p.frame(p.Code.VERSION_MISMATCH, rid, _reason(f"server speaks {p.VERSION}"))
                )
                raise ProtocolError(f"protocol version {version}, expected {p.VERSION}")
            if length > p.MAX_BODY:
                raise ProtocolError(f"a {length}-byte message (limit {p.MAX_BODY})")
            body = _recv_exact(sock, length)
            if body is None:
                raise ProtocolError("connection closed inside a message")
            try:
                request = p.decode_request(op, body)
                if (request.op == p.Op.HELLO) == greeted:
                    raise ProtocolError("HELLO must come first, and once")
            except ProtocolError as exc:
                with contextlib.suppress(OSError):
                    sock.sendall(p.frame(p.Code.BAD_REQUEST, rid, _reason(str(exc))))
                raise
            if request.op == p.Op.HELLO:
                greeted = True
                body = p.hello_reply(
                    p.Hello(self.config.size, self.instance, int(self.config.lease_ttl_s * 1000))
                )
                reply = p.frame(p.Code.OK, rid, body, flags=p.FEATURES)
                socket.send_fds(sock, [reply], [self._arena_fd])
                continue
            if request.op == p.Op.BYE:  # its slot is free before it hears so
                self._release_sessions(client)
                with self._lock:
                    self._clients.discard(client)
                sock.sendall(p.frame(p.Code.OK, rid))
                return
            code, reply = self.handle(client, request)
            sock.sendall(p.frame(code, rid, reply))

    def _await_request(self, client: _Client) -> bool:
        """Wait until the peer sends (or closes); False once it has been silent for
        ``idle_timeout_s`` while holding no session: it is to be closed then."""
        poller = select.poll()
        poller.register(client.sock.fileno(), select.POLLIN)
        timeout_ms = max(1, round(self.config.idle_timeout_s * 1000))
        while not poller.poll(timeout_ms):
            with self._lock:
                idle = not client.sessions  # sessions may still be in use: never idle then
                if idle:
                    self._counters["idle_closed"] += 1
            if idle:
                log.info(
                    "kvflow pool: closing the connection of pid %d, idle for %g s",
                    client.pid,
                    self.config.idle_timeout_s,
                )
                return False
        return True

    def handle(self, client: _Client, request: p.Request) -> tuple[p.Code, bytes]:
        """Apply one decoded request for ``client``; returns the reply's code and body."""
        begun = trace.now() if trace.ENABLED else 0
        try:
            with self._lock:
                self._counters["requests"] += 1
                try:
                    return self._apply(client, request)
                except InvalidArgumentError as exc:
                    return p.Code.INVALID_ARGUMENT, _reason(str(exc))
        finally:
            if begun:
                op = f"pool.{request.op.name.lower()}"
                trace.complete(op, begun, "pool", client=client.pid, keys=len(request.keys))

    def _apply(self, client: _Client, req: p.Request) -> tuple[p.Code, bytes]:
        index = self._index
        if req.op in (p.Op.LOOKUP, p.Op.LOOKUP_CTX):
            return p.Code.OK, p.flags_reply(index.lookup(req.keys, req.context))
        if req.op in (p.Op.OPEN_WRITE, p.Op.OPEN_WRITE_CTX):
            handle, offsets, status = index.open_write(req.keys, req.nbytes, req.context)
            client.sessions.add(handle)
            sizes = np.where(status == WriteStatus.GRANTED, req.nbytes, 0)
            return p.Code.OK, p.session_reply(handle, offsets, sizes, status)
        if req.op in (p.Op.OPEN_READ, p.Op.OPEN_READ_CTX):
            handle, offsets, found, sizes = index.open_read(req.keys, req.context)
            client.sessions.add(handle)
            self._deadlines[handle] = time.monotonic() + self.config.lease_ttl_s
            self._owner[handle] = client
            return p.Code.OK, p.session_reply(handle, offsets, sizes, found)
        if req.op == p.Op.FINISH_WRITE:
            if req.handle not in client.sessions or req.handle in self._deadlines:
                return p.Code.UNKNOWN_SESSION, b""
            assert req.flags is not None
            index.finish_write(req.handle, req.flags)
            client.sessions.discard(req.handle)
            return p.Code.OK, b""
        if req.op == p.Op.CLOSE_READ:
            if req.handle in client.expired:
                client.expired.discard(req.handle)
                return p.Code.EXPIRED, b""
            if req.handle not in client.sessions or req.handle not in self._deadlines:
                return p.Code.UNKNOWN_SESSION, b""
            self._end_session(req.handle)
            client.sessions.discard(req.handle)
            return p.Code.OK, b""
        if req.op == p.Op.STATS:
            return p.Code.OK, p.stats_reply(self._stats())
        raise ProtocolError(f"op {req.op!r} is not served here")

    def _bad(self) -> None:
        with self._lock:
            self._counters["bad_messages"] += 1

    def _release_files(self) -> None:
        path = self.config.socket
        if self._listener is not None:
            for stale in (path, sibling(path, ".pid")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
        if self._arena_fd >= 0:
            os.close(self._arena_fd)
            self._arena_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock: another server may start
            self._lock_fd = -1


def _reason(text: str) -> bytes:
    return text.encode("utf-8", "replace")[:1024]


def _refuse(sock: socket.socket, reason: str) -> None:
    """Answer a refused peer's HELLO with ``Code.REFUSED`` and ``reason`` (the caller closes
    the socket). A peer that says nothing within _REFUSE_WAIT_S gets no reply."""
    sock.settimeout(_REFUSE_WAIT_S)
    with contextlib.suppress(OSError, ProtocolError):
        header = _recv_exact(sock, p.HEADER.size)
        if header is None:
            return
        length, _, _, _, rid = p.HEADER.unpack(header)
        if length <= 64:  # a HELLO's body: read it, so that closing resets nothing
            _recv_exact(sock, length)
        sock.sendall(p.frame(p.Code.REFUSED, rid, _reason(reason)))
        sock.shutdown(socket.SHUT_WR)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None if the peer closed before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _take_lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise PoolRunningError(path.removesuffix(".lock")) from None
    return fd


def _make_arena(size: int) -> int:
    """A memfd of ``size`` bytes, mode 0600, its memory allocated and cleared now.

    ``posix_fallocate`` reserves the pages (a client's copy can never fault on a full tmpfs)
    but leaves them to be cleared on their first fault; writing-faulting them here once pays
    that now, so a client's first touch of a page is a minor fault, not a page clear.
    """
    fd = os.memfd_create("kvflow-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        # no client may resize it: a shrink would fault every process that maps it
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        )
        unmap(map_shared(fd, size, populate=True), size)
    except (OSError, StoreError) as exc:
        os.close(fd)
        raise ConfigError("capacity", size, f"cannot allocate the arena: {exc}") from exc
    return fd
