"""PoolLink: a SharedStore's connection to its pool server, kept across drops and restarts,
and what the client holds on it: its sessions, their pool memory, the copies in flight.

One ``PoolConnection`` is live at a time. A call that finds none (or finds the server gone)
connects again, unless a connect failed less than ``retry_interval_s`` ago: then it fails at
once. Where ``auto_start`` says so and no server answers, the first connection (made at the
store's construction: one-time setup) starts one and waits for it; a later one (the server
stopped or died under load) starts one on a thread of its own and fails at once, so calls count
misses while the new server comes up (seconds: a process, its arena) instead of each waiting
for it, and the first call after it serves connects. A request the server's idle close crossed
goes once more on a new connection, if no session of this client was on the old one.

Every session belongs to the connection that opened it and dies with it: dropping a connection
takes its sessions' memory from the copies (they fail from then on), waits for the copies in
flight, then closes the socket (the server releases the sessions). A dropped connection's
arena stays reserved while a session still holds addresses in it (``past``), so no later
mapping lands where they point; one no session refers to keeps its mapping as the spare, taken
over (pin included) by the next connection to the same server.

Concurrency: ``lock`` (re-entrant) serialises requests, session changes and connection
changes: a caller holds it across a request and the session the reply opens. ``cond`` guards
what copies read (the live connection, the spans of memory held, the in-flight count); copies
take it briefly before and after, never across the copy, and never take ``lock``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvflow.errors import ClosedError, InvalidArgumentError, KVFlowError, StoreUnavailableError
from kvflow.pool import protocol as p
from kvflow.pool.client import PoolConnection
from kvflow.pool.config import SharedStoreConfig
from kvflow.pool.launch import start_in_background
from kvflow.stores.regions import HeldSpans, in_range

__all__ = ["ClientSession", "PoolLink"]

log = logging.getLogger("kvflow")

_DRAIN_TIMEOUT_S = 5.0  # how long a dropped connection waits for copies still running


@dataclass(eq=False)
class ClientSession:
    conn: PoolConnection
    server_handle: int
    writing: bool
    starts: np.ndarray  # absolute pool addresses of the session's objects
    ends: np.ndarray
    deadline: float  # read sessions: when their leases stop counting (monotonic)


class PoolLink:
    """The link to the server ``config`` names. Nothing connects until ``connected()``."""

    def __init__(self, config: SharedStoreConfig) -> None:
        self.config = config
        self.lock = threading.RLock()  # metadata: one request at a time, connection changes
        self.cond = threading.Condition(threading.Lock())  # copies: spans, in-flight count
        self.conn: PoolConnection | None = None
        self.sessions: dict[int, ClientSession] = {}
        self._next_handle = 1
        self._write_spans = HeldSpans()
        self._read_spans = HeldSpans()
        self.in_flight = 0
        self._retry_at = 0.0
        self.closed = False
        self.past: list[PoolConnection] = []  # dropped: arena range kept reserved, no access
        self._parked: list[PoolConnection] = []  # dropped while a copy still ran
        self._spare: PoolConnection | None = None  # dropped without sessions: mapping kept
        self.reconnects = 0
        self._starter: threading.Thread | None = None  # a server being started (auto_start)

    # -- the connection -----------------------------------------------------------------------

    def connected(self) -> PoolConnection:
        """The live connection, reconnecting (or starting a server) when due. Holds lock."""
        if self.closed:
            raise ClosedError("SharedStore")
        conn = self.conn
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
        with self.cond:
            self.conn = conn
        return conn

    def _connect(self) -> PoolConnection:
        cfg = self.config
        try:
            conn = self._open_connection()
        except StoreUnavailableError:
            if not cfg.auto_start:
                raise
            if self.reconnects:  # serving already: start it beside the calls, not in them
                self._start_beside()
                raise
            start_in_background(cfg.server_config(), cfg.start_timeout_s)
            conn = self._open_connection()
        if self.sessions or self.reconnects or self._retry_at:
            log.info("kvflow: connected to the pool on %s", cfg.socket)
        self.reconnects += 1
        return conn

    def _start_beside(self) -> None:
        """Start a server on a thread of its own, unless one is being started. Holds lock."""
        if self._starter is not None and self._starter.is_alive():
            return
        cfg = self.config

        def start() -> None:
            try:
                start_in_background(cfg.server_config(), cfg.start_timeout_s)
            except KVFlowError as exc:  # the next connect fails and tries again
                log.warning("kvflow: starting a pool server on %s failed: %s", cfg.socket, exc)
                return
            self._retry_at = 0.0  # it serves: the next call connects, not one retry later

        log.info("kvflow: the pool on %s is gone; starting one beside the calls", cfg.socket)
        self._starter = threading.Thread(target=start, name="kvflow-pool-start", daemon=True)
        self._starter.start()

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

    def call(
        self,
        op: p.Op,
        body: bytes = b"",
        *,
        retry: bool = True,
        ctx: tuple[p.Op, bytes] | None = None,
    ) -> tuple[PoolConnection, p.Code, bytes]:
        """One request; also returns the connection that carried it (a reply's offsets are
        relative to that connection's arena). Holds lock.

        ``ctx``: the same request with a context (a ``_CTX`` op and its body), sent instead
        where the server understands it (``Feature.CONTEXT``); a server of an earlier release
        gets the plain one.

        If the server had closed the connection (an idle one, closed as this request went out)
        and no session of this client is on it, nothing was lost: the request goes once more,
        on a new connection. ``retry=False`` for requests about a session."""
        conn = self.connected()
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
            return self.call(op, body, retry=False, ctx=ctx)
        return conn, code, reply

    def _holds(self, conn: PoolConnection) -> bool:
        """Whether a session of this client is on ``conn``. Holds lock."""
        return any(s.conn is conn for s in self.sessions.values())

    def _drop(self, conn: PoolConnection, why: str) -> None:
        """Forget a connection: no new copy may use it; once the copies in flight are out,
        the socket closes (the server then releases its sessions) and the arena's memory goes,
        its address range staying reserved while a session still holds addresses in it.
        A copy still running after the drain timeout keeps the socket open (so the server
        hands none of its slots to anyone) until it returns.
        A connection no session refers to keeps its mapping as the spare (see ``_spare``):
        no stale address can point into it, and the next connection to the same server takes
        it over. Holds lock."""
        with self.cond:
            if self.conn is conn:
                self.conn = None
            self._write_spans.drop(conn)
            self._read_spans.drop(conn)
            drained = self.cond.wait_for(lambda: self.in_flight == 0, _DRAIN_TIMEOUT_S)
            if not drained:
                self._parked.append(conn)
        idle = not self.closed and not self._holds(conn)
        if drained:
            self._finish_drop(conn, keep_mapping=idle)
        else:
            log.error(
                "kvflow: a copy still runs after %g s; the old connection waits", _DRAIN_TIMEOUT_S
            )
        if not self.closed:
            if idle:  # nothing lost; the server closes idle connections
                log.info("kvflow: pool connection closed, no session on it (%s)", why)
            else:
                log.warning("kvflow: shared pool connection lost: %s", why)
            self._retry_at = 0.0

    def _finish_drop(self, conn: PoolConnection, keep_mapping: bool = False) -> None:
        conn.goodbye() if self.closed else conn.close()
        if keep_mapping:  # only from _drop, under lock, like every use of _spare
            old, self._spare = self._spare, conn
            if old is not None:
                old.unmap()
            return
        conn.retire()
        with self.cond:
            self.past.append(conn)
        self._forget_past()

    def _forget_past(self) -> None:
        """Free the reserved ranges of dropped connections no session refers to any more."""
        with self.cond:
            live = {id(s.conn) for s in list(self.sessions.values())}
            gone = [c for c in self.past if id(c) not in live]
            self.past = [c for c in self.past if id(c) in live]
        for conn in gone:
            conn.unmap()

    def close(self) -> None:
        """Drop the connection (saying BYE once no copy runs) and forget every session."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.conn is not None:
                self._drop(self.conn, "closed")
            self.sessions.clear()
            if self._spare is not None:
                self._spare.unmap()
                self._spare = None

    # -- sessions -----------------------------------------------------------------------------

    def add(self, session: ClientSession) -> int:
        """Hold ``session``: its memory becomes the copies'. Its local handle. Holds lock."""
        handle = self._next_handle
        self._next_handle += 1
        self.sessions[handle] = session
        spans = self._write_spans if session.writing else self._read_spans
        with self.cond:
            spans.add(handle, session.starts, session.ends, session.deadline, session.conn)
        return handle

    def pop(self, handle: int) -> ClientSession | None:
        """Remove a session; None after close() (a no-op then). Raises for an unknown one.
        Holds lock."""
        session = self.sessions.pop(handle, None)
        if session is None:
            if self.closed:
                return None
            raise InvalidArgumentError("session", handle, "unknown or already finished session")
        with self.cond:
            (self._write_spans if session.writing else self._read_spans).remove(handle)
        if self.past:
            self._forget_past()
        return session

    def end(self, s: ClientSession, op: p.Op, body: bytes) -> tuple[p.Code, bytes]:
        """Send the request that ends ``s`` (never again on another connection). Holds lock."""
        if s.conn is not self.conn or s.conn.broken:
            raise StoreUnavailableError("the pool server went away; the session was released")
        _, code, reply = self.call(op, body, retry=False)
        return code, reply

    # -- copies -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def copying(
        self, pool: np.ndarray, sizes: np.ndarray, reading: bool
    ) -> Iterator[tuple[PoolConnection, np.ndarray, float]]:
        """A copy of these pool ranges, in flight while inside: the connection it is on, per
        range whether this client holds it (``held``), and the earliest deadline of the leases
        used. Refuses ranges outside the arena; a dropped connection waits for it to end."""
        with self.cond:
            conn = self._live()
            _check_arena(conn, self.past, pool, sizes)
            held, deadline = self._held(pool, sizes, reading)
            self.in_flight += 1
        try:
            yield conn, held, deadline
        finally:
            self.copy_ended()

    def writes_held(
        self, pool: np.ndarray, sizes: np.ndarray
    ) -> tuple[PoolConnection, int, np.ndarray]:
        """For ranges a save will copy, checked against the arena: the live connection, the
        write slots' version, and which ranges they hold now (``kvflow.pool.prepared``)."""
        with self.cond:
            conn = self._live()
            _check_arena(conn, self.past, pool, sizes)
            return conn, self._write_spans.version, self._writes_cover(pool, sizes)

    def write_copy_started(
        self, conn: PoolConnection, version: int, pool: np.ndarray, sizes: np.ndarray
    ) -> np.ndarray | None:
        """A prepared write's copy begins (``copy_ended`` after it): None where the write slots
        are as they were when it was prepared, else which of its ranges are still held (none
        once ``conn`` is not the live connection)."""
        with self.cond:
            if self.closed:
                raise ClosedError("SharedStore")
            held = None
            if self.conn is not conn:
                held = np.zeros(sizes.shape, dtype=bool)
            elif self._write_spans.version != version:
                held = self._writes_cover(pool, sizes)
            self.in_flight += 1
        return held

    def copy_ended(self) -> None:
        """A copy is out of the pool's memory; the last one out lets dropped sockets close."""
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()
            parked = self._parked if self.in_flight == 0 else []
            self._parked = [] if parked else self._parked
        for old in parked:
            self._finish_drop(old)

    def _live(self) -> PoolConnection:
        """The live connection, for a copy. Holds cond."""
        if self.closed:
            raise ClosedError("SharedStore")
        if self.conn is None:
            raise StoreUnavailableError("the pool server is not connected")
        return self.conn

    def _writes_cover(self, pool: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Per range: inside one of this client's write slots. Holds cond."""
        return self._write_spans.cover(pool, sizes, None)[0]

    def _held(self, pool: np.ndarray, sizes: np.ndarray, reading: bool) -> tuple[np.ndarray, float]:
        """Per range: inside one of this client's write slots, or (reading) under a live lease;
        and the earliest deadline of the leases used. Holds cond."""
        if not reading:
            return self._writes_cover(pool, sizes), math.inf
        held, deadline = self._read_spans.cover(pool, sizes, time.monotonic())
        if not held.all():  # reading back one's own pending write is allowed too
            held |= self._writes_cover(pool, sizes)
        return held, deadline


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
