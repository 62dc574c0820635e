"""PoolService: the pool server's state and its requests, apart from any socket.

It owns the arena's index and answers requests: a request's op and body go in (decoded,
all-or-nothing), are applied to the index, and the reply's code and body come out, encoded.
Semantics are those of LocalStore (``ArenaIndex``: two-phase writes, read leases, LRU eviction
of committed, unleased objects, a prefix's tail before its head, context keys included: the
``_CTX`` ops), plus ownership: every session belongs to the connection that opened it and is
released when that connection closes, for whatever reason (close, crash, SIGKILL: the server
calls ``disconnect``). Read leases also expire after ``lease_ttl_s`` (``expire``); a client that
later closes such a session is told EXPIRED. Pending writes never expire while their client
lives: their slots may still be being written.

Call order per connection: ``connect`` when the server takes it, ``handle`` for each of its
requests (HELLO first and once; BYE releases its sessions before the reply), ``disconnect``
when it ends (again after BYE is harmless). The service keeps the counters ``stats`` reports,
the admission counts the server tells it (``count``) among them.

With a disk tier (``kvflow.pool.tier``), a connection that asks DISK (and runs as the
server's uid: the files are the server's, mode 0600) sees both tiers: LOOKUP finds what either
holds, and OPEN_READ answers a key on disk only with ``ON_DISK`` for the client to read the
file (``disk_reads`` layerwise, promoted meanwhile), or promotes it first (``promote``).
Commits are queued for disk as they happen; no disk I/O runs in a request but a ``promote``
read's and DISK_DROP's, and never under the lock.

Concurrency: thread-safe. Each connection's calls come from one thread; any number of
connections and the lease thread call at once. One lock guards the index, the sessions, the
leases and the counters, held while one request is applied (microseconds per key). Nothing
here blocks on I/O or sleeps; time is read from ``clock`` (``time.monotonic`` unless a test
gives another), so lease expiry is driven by whoever calls ``expire``.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvflow import trace
from kvflow.errors import InvalidArgumentError, ProtocolError
from kvflow.pool import protocol as p
from kvflow.pool.config import PoolConfig
from kvflow.pool.disk import DiskObjects
from kvflow.pool.tier import DiskTier
from kvflow.stores.arena import ArenaIndex
from kvflow.stores.base import WriteStatus

__all__ = ["COUNTERS", "Connection", "PoolService", "Reply"]

log = logging.getLogger("kvflow.pool")

COUNTERS = (
    "expired_leases",
    "clients_total",
    "released_on_disconnect",
    "refused_peers",
    "bad_messages",
    "requests",
    "refused_limit",
    "idle_closed",
)  # the service's own counters (the rest of STATS_FIELDS: the index's, the config's)


@dataclass(eq=False)
class Connection:
    """One client connection as the service sees it (its socket is the server's)."""

    pid: int
    uid: int
    sessions: set[int] = field(default_factory=set)  # handles this connection opened
    expired: set[int] = field(default_factory=set)  # its read sessions the reaper released
    greeted: bool = False  # HELLO came
    disk: bool = False  # asked DISK and may read the disk tier's files


class Reply(NamedTuple):
    """What to answer a request: the code, the body, the header's flags; ``arena``: send the
    arena's file descriptor with it (HELLO); ``last``: the connection closes after it (BYE)."""

    code: p.Code
    body: bytes = b""
    flags: int = 0
    arena: bool = False
    last: bool = False


class PoolService:
    """The pool's index, sessions, leases and counters for ``config`` (its capacity, lease
    limit; ``max_clients`` and ``idle_timeout_s`` only to report them). ``instance`` tells this
    server from a restarted one on the same path (random unless given). ``disk``: the disk
    tier's objects, under the arena mapped at ``arena`` in this process (``close`` closes
    them)."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        instance: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        disk: DiskObjects | None = None,
        arena: int = 0,
    ) -> None:
        self.config = config
        self.instance = secrets.randbits(63) if instance is None else instance
        self._clock = clock
        self._index = ArenaIndex(config.size)
        self._lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._deadlines: dict[int, float] = {}  # read handle -> expiry (on ``clock``)
        self._owner: dict[int, Connection] = {}  # read handle -> its connection
        self._counters = dict.fromkeys(COUNTERS, 0)
        self.tier: DiskTier | None = None
        self.features = p.FEATURES
        if disk is not None:
            self.tier = DiskTier(disk, self._index, self._lock, arena, reads=config.disk_reads)
            self.features |= p.Feature.DISK

    def close(self) -> None:
        """Stop the disk tier's threads (a copy under way finishes) and close its objects."""
        if self.tier is not None:
            self.tier.close()

    # -- connections --------------------------------------------------------------------------

    @property
    def connections(self) -> int:
        """How many connections are open (connected, not yet disconnected)."""
        with self._lock:
            return len(self._connections)

    def connect(self, pid: int, uid: int) -> Connection:
        """A new connection, of peer process ``pid`` running as ``uid``."""
        conn = Connection(pid, uid)
        with self._lock:
            self._connections.add(conn)
            self._counters["clients_total"] += 1
        return conn

    def disconnect(self, conn: Connection) -> None:
        """The connection ended: its pending writes are aborted, its leases released."""
        with self._lock:
            released = len(conn.sessions)
            for handle in conn.sessions:
                self._end_session(handle)
            conn.sessions.clear()
            self._counters["released_on_disconnect"] += released
            self._connections.discard(conn)
        if released:
            log.info("kvflow pool: client pid %d left; %d sessions released", conn.pid, released)

    def holds_sessions(self, conn: Connection) -> bool:
        """Whether ``conn`` holds a session (a pending write or a read lease)."""
        with self._lock:
            return bool(conn.sessions)

    def count(self, counter: str) -> None:
        """Add one to ``counter`` (one of COUNTERS: what the server saw, such as a refusal)."""
        with self._lock:
            self._counters[counter] += 1

    def stats(self) -> dict[str, int]:
        """Every STATS field."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, int]:
        u = self._index.usage()
        values = {name: getattr(u, name) for name in p.STATS_FIELDS if hasattr(u, name)}
        values.update(self._counters, clients=len(self._connections))
        values.update(
            max_clients=self.config.max_clients,
            idle_timeout_ms=round(self.config.idle_timeout_s * 1000),
        )
        tier = self.tier.stats() if self.tier is not None else {}
        values.update({name: tier.get(name, 0) for name in p.STATS_FIELDS if name not in values})
        return values

    # -- leases -------------------------------------------------------------------------------

    def expire(self) -> int:
        """Release the read sessions whose ``lease_ttl_s`` has run out; how many."""
        now = self._clock()
        with self._lock:
            due = [h for h, t in self._deadlines.items() if t <= now]
            for handle in due:
                conn = self._owner.pop(handle)
                del self._deadlines[handle]
                self._index.close_read(handle)
                if self.tier is not None:
                    self.tier.ended(handle)
                conn.sessions.discard(handle)
                conn.expired.add(handle)
                self._counters["expired_leases"] += 1
                log.warning(
                    "kvflow pool: a lease of client pid %d ran past %g s and was released",
                    conn.pid,
                    self.config.lease_ttl_s,
                )
        return len(due)

    def _end_session(self, handle: int) -> None:
        """Close a read session or abort a write. Holds _lock."""
        if handle in self._deadlines:
            del self._deadlines[handle]
            del self._owner[handle]
            self._index.close_read(handle)
            if self.tier is not None:
                self.tier.ended(handle)
        else:
            self._index.finish_write(handle, np.zeros(0, dtype=bool))

    # -- requests -----------------------------------------------------------------------------

    def handle(self, conn: Connection, op: int, body: bytes) -> Reply:
        """Decode and apply one request of ``conn``; the reply to send.

        Raises ProtocolError, having changed nothing, for a malformed request (an unknown op,
        a bad body, HELLO not first or twice): the connection must then end (the server
        answers BAD_REQUEST with the error's text, and disconnects).
        """
        request = p.decode_request(op, body)
        if (request.op == p.Op.HELLO) == conn.greeted:
            raise ProtocolError("HELLO must come first, and once")
        if request.op == p.Op.HELLO:
            conn.greeted = True
            ttl_ms = int(self.config.lease_ttl_s * 1000)
            hello = p.hello_reply(p.Hello(self.config.size, self.instance, ttl_ms))
            return Reply(p.Code.OK, hello, flags=self.features, arena=True)
        if request.op == p.Op.BYE:  # its slot is free before it hears so
            self.disconnect(conn)
            return Reply(p.Code.OK, last=True)
        if request.op in (p.Op.DISK, p.Op.DISK_DROP):
            return self._disk_request(conn, request)
        if request.op in (p.Op.OPEN_READ, p.Op.OPEN_READ_CTX):
            self._promote_first(conn, request)
        begun = trace.now() if trace.ENABLED else 0
        try:
            with self._lock:
                self._counters["requests"] += 1
                try:
                    return Reply(*self._apply(conn, request))
                except InvalidArgumentError as exc:
                    return Reply(p.Code.INVALID_ARGUMENT, reason(str(exc)))
        finally:
            if begun:
                name = f"pool.{request.op.name.lower()}"
                trace.complete(name, begun, "pool", client=conn.pid, keys=len(request.keys))

    def _disk_request(self, conn: Connection, req: p.Request) -> Reply:
        """DISK: the tier's folder, to a client of the server's uid (empty to others);
        DISK_DROP: delete objects a client found bad."""
        tier = self.tier
        if tier is None:
            raise ProtocolError(f"op {req.op!r} needs a disk tier")
        if req.op == p.Op.DISK_DROP:
            tier.drop(req.keys)
            return Reply(p.Code.OK)
        with self._lock:
            conn.disk = conn.uid == os.getuid()
        return Reply(p.Code.OK, reason(tier.disk.root) if conn.disk else b"")

    def _promote_first(self, conn: Connection, req: p.Request) -> None:
        """``disk_reads`` promote: copy the keys on disk only into DRAM before the read."""
        tier = self.tier
        if tier is None or not conn.disk or tier.reads != "promote":
            return
        with self._lock:
            keys = [k for k in req.keys if not self._index.holds(k)]
        tier.promote(keys)

    def _apply(self, conn: Connection, req: p.Request) -> tuple[p.Code, bytes]:
        """One data request. Holds _lock."""
        index = self._index
        tier = self.tier if conn.disk else None
        if req.op in (p.Op.LOOKUP, p.Op.LOOKUP_CTX):
            found = index.lookup(req.keys, req.context)
            if tier is not None:
                found |= tier.lookup(req.keys, found, req.context, hits=True)
            return p.Code.OK, p.flags_reply(found)
        if req.op in (p.Op.OPEN_WRITE, p.Op.OPEN_WRITE_CTX):
            handle, offsets, status = index.open_write(req.keys, req.nbytes, req.context)
            conn.sessions.add(handle)
            sizes = np.where(status == WriteStatus.GRANTED, req.nbytes, 0)
            return p.Code.OK, p.session_reply(handle, offsets, sizes, status)
        if req.op in (p.Op.OPEN_READ, p.Op.OPEN_READ_CTX):
            handle, offsets, found, sizes = index.open_read(req.keys, req.context)
            conn.sessions.add(handle)
            self._deadlines[handle] = self._clock() + self.config.lease_ttl_s
            self._owner[handle] = conn
            flags = found.astype(np.uint8)
            if tier is not None:
                on_disk = tier.lookup(req.keys, found, req.context, hits=False)
                if on_disk.any():
                    sizes = np.where(on_disk, tier.sizes(req.keys), sizes)
                    on_disk &= sizes > 0
                    flags[on_disk] = p.ON_DISK
                    served = [k for k, d in zip(req.keys, on_disk, strict=True) if d]
                    tier.served(handle, served)
            return p.Code.OK, p.session_reply(handle, offsets, sizes, flags)
        if req.op == p.Op.FINISH_WRITE:
            if req.handle not in conn.sessions or req.handle in self._deadlines:
                return p.Code.UNKNOWN_SESSION, b""
            assert req.flags is not None
            committed = index.finish_write(req.handle, req.flags)
            if self.tier is not None and committed:
                self.tier.committed(*zip(*committed, strict=True))
            conn.sessions.discard(req.handle)
            return p.Code.OK, b""
        if req.op == p.Op.CLOSE_READ:
            if req.handle in conn.expired:
                conn.expired.discard(req.handle)
                return p.Code.EXPIRED, b""
            if req.handle not in conn.sessions or req.handle not in self._deadlines:
                return p.Code.UNKNOWN_SESSION, b""
            self._end_session(req.handle)
            conn.sessions.discard(req.handle)
            return p.Code.OK, b""
        if req.op == p.Op.STATS:
            return p.Code.OK, p.stats_reply(self._stats())
        raise ProtocolError(f"op {req.op!r} is not served here")


def reason(text: str) -> bytes:
    """A reply's UTF-8 reason, at most 1024 bytes."""
    return text.encode("utf-8", "replace")[:1024]
