"""PoolServer: the node-local pool's sockets. It owns the arena; clients copy the bytes.

The arena is a memfd (mode 0600, never a named file) sealed against resizing, whose memory is
allocated at start, so a client's copy can never fault on a full tmpfs and no client can
shrink it under the others; its pages are cleared on a thread while the server already
serves. Clients receive
its file descriptor once, in the HELLO reply (SCM_RIGHTS), map it, and from then on send only
metadata: lookup, open for write or read, commit or abort, release. What a request does, the
sessions each connection owns and the leases' expiry are the ``PoolService``'s
(``kvflow.pool.service``): the server accepts, admits, reads frames and hands them over.

Connections: at most ``max_clients`` at once. One more is refused with a reply that says why
(``Code.REFUSED`` to its HELLO), counted in ``refused_limit``. A connection that holds no session
and sends nothing for ``idle_timeout_s`` is closed (``idle_closed``), so idle or stuck peers
cannot lock clients out; a SharedStore reconnects on its next call without failing it.

Concurrency: one thread accepts, one thread serves each connection (blocking reads of one frame
at a time), one thread expires leases (``PoolService.expire``); the service's one lock guards
the index, held while a request is applied (microseconds per key). ``stop()`` is idempotent and
may be called from any thread or a signal handler's thread; connections accepted while it runs
are refused. A malformed or oversized message, or a peer of another uid, closes that connection
only, with a logged reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvflow.errors import ConfigError, PoolRunningError, ProtocolError
from kvflow.pool import protocol as p
from kvflow.pool.config import (
    DEFAULT_CAPACITY,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_CLIENTS,
    PoolConfig,
)
from kvflow.pool.disk import DiskObjects, check_folder
from kvflow.pool.memory import clear_pages, make_arena, map_shared, unmap
from kvflow.pool.paths import ensure_private_directory, sibling
from kvflow.pool.service import Connection, PoolService, reason
from kvflow.stores.hostmem import check_capacity

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_MAX_CLIENTS",
    "PoolConfig",
    "PoolServer",
]  # the config's names stay importable from here

log = logging.getLogger("kvflow.pool")

_BODY_TIMEOUT_S = 10.0  # once a header arrived, its body must follow within this
_REFUSE_WAIT_S = 1.0  # a refused peer's HELLO is awaited this long, to answer it
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    conn: Connection  # its state in the service

    @property
    def pid(self) -> int:
        return self.conn.pid


class PoolServer:
    """Serve one arena on ``config.socket``. ``start()`` returns once clients can connect.

    Raises PoolRunningError if another server holds the socket path, ConfigError (before
    anything is created) if the capacity exceeds the memory available (``kvflow.stores.hostmem``).
    ``stop()`` closes every connection, removes the socket and frees the arena (clients that
    mapped it keep their mapping until they notice and reconnect). ``service`` is the pool's
    state and request handling; ``stats()`` its counters.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self.service = PoolService(self.config)
        self.instance = self.service.instance
        self._lock = threading.Lock()  # admission, the client sockets, the threads
        self._socks: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._lock_fd = -1
        self._arena_fd = -1
        self._arena_addr = 0  # this process's mapping of the arena (for the disk tier)

    @property
    def socket_path(self) -> str:
        return self.config.socket

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        path = self.config.socket
        check_capacity(self.config.size, self.config.size)  # before any file or memory
        _check_disk(self.config)
        ensure_private_directory(os.path.dirname(path))
        self._lock_fd = _take_lock(sibling(path, ".lock"))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        disk = None
        clearing = 0  # the mapping the arena is cleared through
        try:
            if self.config.disk_dir:  # after the lock: a running server's files are its own
                disk = DiskObjects(self.config.disk_dir, self.config.disk_capacity)
            self._arena_fd = make_arena(self.config.size)
            clearing = map_shared(self._arena_fd, self.config.size, populate=False)
            if disk is not None:
                self._arena_addr = map_shared(self._arena_fd, self.config.size, populate=False)
                self.service = PoolService(
                    self.config, instance=self.instance, disk=disk, arena=self._arena_addr
                )
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
            if clearing:
                unmap(clearing, self.config.size)
            listener.close()
            self.service.close()
            if disk is not None:
                disk.close()
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self._release_files()
            raise
        self._listener = listener
        self._spawn(self._accept_loop, "kvflow-pool-accept")
        self._spawn(self._reap_loop, "kvflow-pool-leases")
        self._spawn(self._clear_arena, "kvflow-pool-clear", clearing)
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
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self.service.close()
        self._release_files()
        log.info("kvflow pool: stopped")

    def __enter__(self) -> PoolServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, int]:
        """Every STATS field (``kvflow.pool.protocol.STATS_FIELDS``)."""
        return self.service.stats()

    # -- threads ------------------------------------------------------------------------------

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _clear_arena(self, addr: int) -> None:
        """Clear the arena's pages while serving (a start that waited for it would keep the
        clients' calls failing as misses for longer: a second or more per GiB on a loaded
        machine); then drop this mapping of it."""
        try:
            clear_pages(addr, self.config.size, self._stopped.is_set)
        finally:
            unmap(addr, self.config.size)

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
            self.service.expire()

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
            self.service.count("bad_messages")
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
        with self._lock:  # one admission at a time: the limit holds
            if self._stopped.is_set():
                return None, "the pool server is stopping"
            if uid != os.getuid() and uid not in self.config.allow_uids:
                self.service.count("refused_peers")
                log.warning("kvflow pool: refusing pid %d of uid %d (not allowed)", pid, uid)
                return None, f"uid {uid} is not allowed (kvflow serve --allow-uid)"
            limit = self.config.max_clients
            if self.service.connections >= limit:
                self.service.count("refused_limit")
                log.warning("kvflow pool: refusing pid %d: %d clients already", pid, limit)
                return None, (
                    f"it serves its limit of {limit} connections (kvflow serve --max-clients); "
                    f"idle ones close after {self.config.idle_timeout_s:g} s, try again then"
                )
            self._socks.add(sock)
            return _Client(sock, self.service.connect(pid, uid)), ""

    def _disconnect(self, client: _Client) -> None:
        self.service.disconnect(client.conn)
        with self._lock:
            self._socks.discard(client.sock)
        client.sock.close()

    # -- one connection -----------------------------------------------------------------------

    def _converse(self, client: _Client) -> None:
        sock = client.sock
        while self._await_request(client):
            sock.settimeout(_BODY_TIMEOUT_S)
            try:
                frame = p.read_frame(sock)
            except EOFError as exc:
                raise ProtocolError(str(exc)) from None
            if frame is None:
                return
            if frame.version != p.VERSION:
                why = reason(f"server speaks {p.VERSION}")
                sock.sendall(p.frame(p.Code.VERSION_MISMATCH, frame.request_id, why))
                raise ProtocolError(f"protocol version {frame.version}, expected {p.VERSION}")
            try:
                reply = self.service.handle(client.conn, frame.kind, frame.body)
            except ProtocolError as exc:
                with contextlib.suppress(OSError):
                    sock.sendall(p.frame(p.Code.BAD_REQUEST, frame.request_id, reason(str(exc))))
                raise
            out = p.frame(reply.code, frame.request_id, reply.body, flags=reply.flags)
            if reply.arena:
                socket.send_fds(sock, [out], [self._arena_fd])
            else:
                sock.sendall(out)
            if reply.last:
                return

    def _await_request(self, client: _Client) -> bool:
        """Wait until the peer sends (or closes); False once it has been silent for
        ``idle_timeout_s`` while holding no session: it is to be closed then."""
        poller = select.poll()
        poller.register(client.sock.fileno(), select.POLLIN)
        timeout_ms = max(1, round(self.config.idle_timeout_s * 1000))
        while not poller.poll(timeout_ms):
            if not self.service.holds_sessions(client.conn):  # sessions may still be in use
                self.service.count("idle_closed")
                log.info(
                    "kvflow pool: closing the connection of pid %d, idle for %g s",
                    client.pid,
                    self.config.idle_timeout_s,
                )
                return False
        return True

    def _release_files(self) -> None:
        path = self.config.socket
        if self._listener is not None:
            for stale in (path, sibling(path, ".pid")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
        if self._arena_addr:
            unmap(self._arena_addr, self.config.size)
            self._arena_addr = 0
        if self._arena_fd >= 0:
            os.close(self._arena_fd)
            self._arena_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock: another server may start
            self._lock_fd = -1


def _check_disk(config: PoolConfig) -> None:
    """The disk tier's options, checked before anything is created (ConfigError)."""
    if not config.disk_dir and not config.disk_capacity:
        return
    if not config.disk_dir:
        raise ConfigError("disk_dir", "", "needed with a disk capacity")
    if not config.disk_capacity:
        raise ConfigError("disk_capacity", 0, "needed with a disk folder")
    check_folder(config.disk_dir, config.disk_capacity)


def _refuse(sock: socket.socket, why: str) -> None:
    """Answer a refused peer's HELLO with ``Code.REFUSED`` and ``why`` (the caller closes
    the socket). A peer that says nothing within _REFUSE_WAIT_S gets no reply."""
    sock.settimeout(_REFUSE_WAIT_S)
    with contextlib.suppress(OSError):
        header = p.recv_exact(sock, p.HEADER.size)
        if len(header) < p.HEADER.size:
            return
        length, _, _, _, rid = p.HEADER.unpack(header)
        if length <= 64:  # a HELLO's body: read it, so that closing resets nothing
            p.recv_exact(sock, length)
        sock.sendall(p.frame(p.Code.REFUSED, rid, reason(why)))
        sock.shutdown(socket.SHUT_WR)


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
