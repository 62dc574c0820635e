"""SharedStore: a client of the node-local pool server (``kvflow serve``).

Metadata goes over the server's Unix socket, one request per store call (so a few round trips
per request batch, never per layer). Bytes never do: the client maps the server's arena and
``batch_copy`` copies directly between it and local memory, with the same copy loop as
LocalStore.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from kvflow.errors import (
    ClosedError,
    InvalidArgumentError,
    KVFlowError,
    StoreError,
    StoreUnavailableError,
)
from kvflow.pool import protocol as p
from kvflow.pool.client import PoolConnection, query_stats
from kvflow.pool.launch import start_in_background
from kvflow.pool.store_config import SharedStoreConfig
from kvflow.stores.base import Direction, ReadSession, Store, StoreUsage, WriteSession, WriteStatus
from kvflow.stores.copyloop import NATIVE, copy_ranges
from kvflow.stores.regions import HeldSpans, LocalRegions, in_range

__all__ = ["SharedStore", "SharedStoreConfig"]

log = logging.getLogger("kvflow")

_LEASE_MARGIN = 0.1  # a lease counts as lost this share of its time limit before the server's
_DRAIN_TIMEOUT_S = 5.0  # how long a dropped connection waits for copies still running


@dataclass(eq=False)
class _Session:
    conn: PoolConnection
    server_handle: int
    writing: bool
    starts: np.ndarray  # absolute pool addresses of the session's objects
    ends: np.ndarray
    deadline: float  # read sessions: when their leases stop counting (monotonic)


class SharedStore(Store):
    """A store whose pool lives in a ``kvflow serve`` process on this machine.

    ``SharedStore()`` connects to the default socket; ``SharedStore(socket=..., auto_start=True,
    capacity="8GiB")`` starts a server if none runs. The first connect happens at construction;
    if it fails the store starts out down and keeps retrying (``retry_interval_s``).

    When the server is down or stops answering, metadata calls raise StoreUnavailableError (the
    engine turns that into misses and skipped saves) and copies for sessions of the lost
    connection fail; the next call after ``retry_interval_s`` reconnects, to a restarted server
    too. A copy only ever touches pool memory this client holds: its granted write slots, or
    objects under a live read lease (checked against the lease's time limit before and after
    the copy), so a lost lease can never pass torn bytes off as loaded (on a CUDA GPU the
    consumer's kernels may already have run when the check after the copy fails: the chunk is
    still reported failed, and an inference server recomputes it).

    The server closes a connection that holds no session and has been idle for its idle
    timeout (``kvflow serve --idle-timeout``); the next call reconnects without failing, also
    when the close crosses that call's request, and keeps the arena's mapping (and pin) when
    the server is the same one.

    KV caches on a CUDA GPU are copied by the GPU (``kvflow.devices.CudaDevice``); this
    process's mapping of the arena is pinned for that when a GPU is present (``pin``).

    The pool evicts a prefix's tail before its head, and takes context
    (``SupportsPrefixContext``; a server of an earlier release that does not is sent the plain
    calls).

    Concurrency: every method is thread-safe. Metadata calls share one connection and take one
    lock (a round trip each); ``batch_copy`` takes no lock across the copy and runs on several
    threads at once, without the GIL. ``close()`` closes the connection (the server releases
    this client's sessions) after copies in flight have finished.
    """

    inline_metadata = False
    device_memory = frozenset({"cpu", "cuda"})

    def __init__(self, config: SharedStoreConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise InvalidArgumentError("options", sorted(options), "give a config or options")
        self.config = config or SharedStoreConfig.from_dict(options)
        self._native_copy = NATIVE
        self._regions = LocalRegions()
        self._lock = threading.RLock()  # metadata: one request at a time, connection changes
        self._cond = threading.Condition(threading.Lock())  # copies: spans, in-flight count
        self._conn: PoolConnection | None = None
        self._sessions: dict[int, _Session] = {}
        self._next_handle = 1
        self._write_spans = HeldSpans()
        self._read_spans = HeldSpans()
        self._in_flight = 0
        self._retry_at = 0.0
        self._closed = False
        self._past: list[PoolConnection] = []  # dropped: arena range kept reserved, no access
        self._parked: list[PoolConnection] = []  # dropped while a copy still ran
        self._spare: PoolConnection | None = None  # dropped without sessions: mapping kept
        self.reconnects = 0
        try:
            with self._lock:
                self._connected()
        except StoreUnavailableError as exc:
            log.warning("kvflow: shared pool unavailable for now: %s", exc)

    @property
    def socket_path(self) -> str:
        return self.config.socket

    # -- the Store interface ------------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._regions.register(regions)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        return self.lookup_with_context(keys, ())

    def lookup_with_context(self, keys: Sequence[str], context: Sequence[str]) -> np.ndarray:
        keys, context = tuple(keys), tuple(context)
        with self._lock:
            ctx = (p.Op.LOOKUP_CTX, p.keys_context_body(keys, context)) if context else None
            _, code, body = self._call_on(p.Op.LOOKUP, p.encode_keys(keys), ctx=ctx)
            self._expect_ok(code, body, "lookup")
            return p.parse_flags(body, len(keys)).astype(bool)

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        return self.open_write_with_context(keys, nbytes, ())

    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession:
        keys, context = tuple(keys), tuple(context)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
            raise InvalidArgumentError("nbytes", nbytes, "must be an integer >= 1")
        n = int(nbytes)
        with self._lock:
            ctx = None
            if context:
                ctx = (p.Op.OPEN_WRITE_CTX, p.open_write_context_body(keys, n, context))
            conn, code, body = self._call_on(p.Op.OPEN_WRITE, p.open_write_body(keys, n), ctx=ctx)
            self._expect_ok(code, body, "open_write")
            handle, offsets, sizes, status = p.parse_session(body, len(keys))
            granted = status == WriteStatus.GRANTED
            addrs = np.where(granted, offsets + conn.base, 0)
            local = self._add(
                _Session(
                    conn, handle, True, addrs[granted], addrs[granted] + sizes[granted], math.inf
                )
            )
        return WriteSession(local, keys, addrs, status.astype(np.int8))

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        ok = np.asarray(ok, dtype=bool)
        if ok.shape != (len(session.keys),):
            raise InvalidArgumentError("ok", ok.shape, f"expected {len(session.keys)} flags")
        with self._lock:
            s = self._pop(session.handle)
            if s is None:
                return
            code, _ = self._end(s, p.Op.FINISH_WRITE, p.finish_write_body(s.server_handle, ok))
            if code != p.Code.OK:
                raise StoreError(f"finish_write: the pool did not commit ({code.name})", int(code))

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        return self.open_read_with_context(keys, ())

    def open_read_with_context(self, keys: Sequence[str], context: Sequence[str]) -> ReadSession:
        keys, context = tuple(keys), tuple(context)
        with self._lock:
            sent = time.monotonic()
            ctx = (p.Op.OPEN_READ_CTX, p.keys_context_body(keys, context)) if context else None
            conn, code, body = self._call_on(p.Op.OPEN_READ, p.encode_keys(keys), ctx=ctx)
            self._expect_ok(code, body, "open_read")
            handle, offsets, sizes, found = p.parse_session(body, len(keys))
            found = found.astype(bool)
            addrs = np.where(found, offsets + conn.base, 0)
            ttl = conn.hello.lease_ttl_ms / 1000
            deadline = sent + ttl * (1 - _LEASE_MARGIN)
            local = self._add(
                _Session(conn, handle, False, addrs[found], addrs[found] + sizes[found], deadline)
            )
        return ReadSession(local, keys, addrs, found)

    def close_read(self, session: ReadSession) -> None:
        with self._lock:
            s = self._pop(session.handle)
            if s is None:
                return
            code, _ = self._end(s, p.Op.CLOSE_READ, p.handle_body(s.server_handle))
            if code == p.Code.EXPIRED:
                raise StoreError(
                    "close_read: the leases ran past their time limit", int(p.Code.EXPIRED)
                )
            if code != p.Code.OK:
                raise StoreError(f"close_read: the pool lost the leases ({code.name})", int(code))

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        self._regions.check_call(pool_addrs, local_addrs, sizes, direction)
        reading = direction == Direction.FROM_POOL
        with self._cond:
            conn = self._conn
            if self._closed:
                raise ClosedError("SharedStore")
            if conn is None:
                raise StoreUnavailableError("the pool server is not connected")
            _check_arena(conn, self._past, pool_addrs, sizes)
            held, deadline = self._held(pool_addrs, sizes, reading)
            self._in_flight += 1
        try:
            if conn.peer_gone():
                held[:] = False
            elif held.any():
                dst, src = (local_addrs, pool_addrs) if reading else (pool_addrs, local_addrs)
                if not held.all():
                    dst, src, sizes = dst[held], src[held], sizes[held]
                copy_ranges(dst, src, sizes, native=self._native_copy)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
                parked = self._parked if self._in_flight == 0 else []
                self._parked = [] if parked else self._parked
            for old in parked:  # the last straggler is out: their sockets may close now
                self._finish_drop(old)
        if reading and (self._conn is not conn or time.monotonic() >= deadline or conn.peer_gone()):
            held[:] = False  # the leases must still hold now that the bytes are in
        failed: np.ndarray = np.flatnonzero(~held)
        return failed

    def _held(self, pool: np.ndarray, sizes: np.ndarray, reading: bool) -> tuple[np.ndarray, float]:
        """Per range: inside one of this client's write slots, or (reading) under a live lease;
        and the earliest deadline of the leases used."""
        if not reading:
            return self._write_spans.cover(pool, sizes, None)[0], math.inf
        held, deadline = self._read_spans.cover(pool, sizes, time.monotonic())
        if not held.all():  # reading back one's own pending write is allowed too
            held |= self._write_spans.cover(pool, sizes, None)[0]
        return held, deadline

    def usage(self) -> StoreUsage:
        stats = self.server_stats()
        return StoreUsage(**{f.name: stats[f.name] for f in fields(StoreUsage)})

    def server_stats(self) -> dict[str, int]:
        """Every counter the server keeps (``kvflow.pool.protocol.STATS_FIELDS``). After
        ``close()`` this asks over a connection of its own."""
        with self._lock:
            if self._closed:
                return query_stats(self.config.socket, self.config.timeout_s)
            code, body = self._call(p.Op.STATS)
            self._expect_ok(code, body, "stats")
            return p.parse_stats(body)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._conn is not None:
                self._drop(self._conn, "closed")
            self._sessions.clear()
            if self._spare is not None:
                self._spare.unmap()
                self._spare = None

    def __repr__(self) -> str:
        conn = self._conn
        return (
            f"SharedStore(socket={self.config.socket!r}, connected={conn is not None}, "
            f"sessions={len(self._sessions)}, in_flight={self._in_flight}, "
            f"reconnects={self.reconnects}, closed={self._closed})"
        )

    # -- the connection -----------------------------------------------------------------------

    def _connected(self) -> PoolConnection:
        """The live connection, reconnecting (or starting a server) when due. Holds _lock."""
        if self._closed:
            raise ClosedError("SharedStore")
        conn = self._conn
        if conn is not None and conn.peer_gone():
            self._drop(conn, "the pool server closed the connection")
            conn = None
        if conn is not None:
            return conn
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnavailableError(f"the pool on {self.config.socket} is down; retrying soon")
        try:
            conn = self._connect()
        except KVFlowError:
            self._retry_at = time.monotonic() + self.config.retry_interval_s
            raise
        with self._cond:
            self._conn = conn
        return conn

    def _connect(self) -> PoolConnection:
        cfg = self.config
        try:
            conn = self._open_connection()
        except StoreUnavailableError:
            if not cfg.auto_start:
                raise
            start_in_background(cfg.server_config(), cfg.start_timeout_s)
            conn = self._open_connection()
        if self._sessions or self.reconnects or self._retry_at:
            log.info("kvflow: connected to the pool on %s", cfg.socket)
        self.reconnects += 1
        return conn

    def _open_connection(self) -> PoolConnection:
        cfg = self.config
        spare, self._spare = self._spare, None
        try:
            conn = PoolConnection(
                cfg.socket,
                cfg.timeout_s,
                populate=cfg.populate,
                trusted_uids=cfg.server_uids,
                pin=cfg.pin,
                reuse=spare,
            )
        except BaseException:
            self._spare = spare  # for a later try
            raise
        if spare is not None:
            spare.unmap()  # a no-op when the new connection took its mapping over
        return conn

    def _call(self, op: p.Op, body: bytes = b"") -> tuple[p.Code, bytes]:
        _, code, reply = self._call_on(op, body)
        return code, reply

    def _call_on(
        self,
        op: p.Op,
        body: bytes = b"",
        *,
        retry: bool = True,
        ctx: tuple[p.Op, bytes] | None = None,
    ) -> tuple[PoolConnection, p.Code, bytes]:
        """One request; also returns the connection that carried it (a reply's offsets are
        relative to that connection's arena). Holds _lock.

        ``ctx``: the same request with a context (a ``_CTX`` op and its body), sent instead
        where the server understands it (``Feature.CONTEXT``); a server of an earlier release
        gets the plain one.

        If the server had closed the connection (an idle one, closed as this request went out)
        and no session of this client is on it, nothing was lost: the request goes once more,
        on a new connection. ``retry=False`` for requests about a session."""
        conn = self._connected()
        sent = ctx if ctx is not None and conn.features & p.Feature.CONTEXT else (op, body)
        try:
            code, reply = conn.request(*sent)
        except KVFlowError as exc:
            again = retry and conn.hung_up and not self._holds(conn)
            self._drop(conn, str(exc))
            if not again:
                raise StoreUnavailableError(
                    f"the pool on {self.config.socket} is down: {exc}"
                ) from exc
            return self._call_on(op, body, retry=False, ctx=ctx)
        return conn, code, reply

    def _holds(self, conn: PoolConnection) -> bool:
        """Whether a session of this client is on ``conn``. Holds _lock."""
        return any(s.conn is conn for s in self._sessions.values())

    def _drop(self, conn: PoolConnection, why: str) -> None:
        """Forget a connection: no new copy may use it; once the copies in flight are out,
        the socket closes (the server then releases its sessions) and the arena's memory goes,
        its address range staying reserved while a session still holds addresses in it.
        A copy still running after the drain timeout keeps the socket open (so the server
        hands none of its slots to anyone) until it returns.
        A connection no session refers to keeps its mapping as the spare (see ``_spare``):
        no stale address can point into it, and the next connection to the same server takes
        it over. Holds _lock."""
        with self._cond:
            if self._conn is conn:
                self._conn = None
            self._write_spans.drop(conn)
            self._read_spans.drop(conn)
            drained = self._cond.wait_for(lambda: self._in_flight == 0, _DRAIN_TIMEOUT_S)
            if not drained:
                self._parked.append(conn)
        idle = not self._closed and not self._holds(conn)
        if drained:
            self._finish_drop(conn, keep_mapping=idle)
        else:
            log.error(
                "kvflow: a copy still runs after %g s; the old connection waits", _DRAIN_TIMEOUT_S
            )
        if not self._closed:
            if idle:  # nothing lost; the server closes idle connections
                log.info("kvflow: pool connection closed, no session on it (%s)", why)
            else:
                log.warning("kvflow: shared pool connection lost: %s", why)
            self._retry_at = 0.0

    def _finish_drop(self, conn: PoolConnection, keep_mapping: bool = False) -> None:
        conn.goodbye() if self._closed else conn.close()
        if keep_mapping:  # only from _drop, under _lock, like every use of _spare
            old, self._spare = self._spare, conn
            if old is not None:
                old.unmap()
            return
        conn.retire()
        with self._cond:
            self._past.append(conn)
        self._forget_past()

    def _forget_past(self) -> None:
        """Free the reserved ranges of dropped connections no session refers to any more."""
        with self._cond:
            live = {id(s.conn) for s in list(self._sessions.values())}
            gone = [c for c in self._past if id(c) not in live]
            self._past = [c for c in self._past if id(c) in live]
        for conn in gone:
            conn.unmap()

    # -- sessions -----------------------------------------------------------------------------

    def _add(self, session: _Session) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self._sessions[handle] = session
        spans = self._write_spans if session.writing else self._read_spans
        with self._cond:
            spans.add(handle, session.starts, session.ends, session.deadline, session.conn)
        return handle

    def _pop(self, handle: int) -> _Session | None:
        """Remove a session; None after close() (a no-op then). Raises for an unknown one."""
        session = self._sessions.pop(handle, None)
        if session is None:
            if self._closed:
                return None
            raise InvalidArgumentError("session", handle, "unknown or already finished session")
        with self._cond:
            (self._write_spans if session.writing else self._read_spans).remove(handle)
        if self._past:
            self._forget_past()
        return session

    def _end(self, s: _Session, op: p.Op, body: bytes) -> tuple[p.Code, bytes]:
        if s.conn is not self._conn or s.conn.broken:
            raise StoreUnavailableError("the pool server went away; the session was released")
        _, code, reply = self._call_on(op, body, retry=False)
        return code, reply

    @staticmethod
    def _expect_ok(code: p.Code, body: bytes, what: str) -> None:
        if code == p.Code.INVALID_ARGUMENT:
            raise InvalidArgumentError(what, body.decode("utf-8", "replace"), "refused by the pool")
        if code != p.Code.OK:
            raise StoreError(
                f"{what}: pool replied {code.name}: {body.decode('utf-8', 'replace')}", int(code)
            )


def _check_arena(
    conn: PoolConnection, past: list[PoolConnection], pool: np.ndarray, sizes: np.ndarray
) -> None:
    """Refuse ranges outside the mapped arena (bad input, not a store failure). Ranges inside
    the reserved range of a dropped connection's arena pass: they belong to sessions the pool
    lost, which the lease checks then fail."""
    if pool.size == 0:
        return
    outside = ~in_range(conn.base, conn.capacity, pool, sizes)
    for old in past:
        if not outside.any():
            return
        outside &= ~in_range(old.base, old.capacity, pool, sizes)
    if outside.any():
        bad = hex(int(pool[outside][0]))
        raise InvalidArgumentError("pool_addrs", bad, "outside the pool's arena")
