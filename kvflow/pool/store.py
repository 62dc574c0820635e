"""SharedStore: a client of the node-local pool server (``kvflow serve``).

Metadata goes over the server's Unix socket, one request per store call (so a few round trips
per request batch, never per layer). Bytes never do: the client maps the server's arena and
``batch_copy`` copies directly between it and local memory, with the same copy loop as
LocalStore. The connection (reconnects, sessions, copies in flight) is ``kvflow.pool.link``'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from kvflow.copying.host import NATIVE, copy_ranges
from kvflow.errors import InvalidArgumentError, KVFlowError, StoreError, StoreUnavailableError
from kvflow.pool import protocol as p
from kvflow.pool.client import PoolConnection, query_stats
from kvflow.pool.config import SharedStoreConfig
from kvflow.pool.diskread import DiskReads
from kvflow.pool.link import ClientSession, PoolLink
from kvflow.pool.prepared import ArenaWrites
from kvflow.stores.base import Direction, ReadSession, Store, StoreUsage, WriteSession, WriteStatus
from kvflow.stores.regions import LocalRegions

__all__ = ["SharedStore", "SharedStoreConfig"]

log = logging.getLogger("kvflow")

_LEASE_MARGIN = 0.1  # a lease counts as lost this share of its time limit before the server's


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

    A chunk the pool's disk tier holds (``kvflow serve --disk-dir``) and its DRAM does not is
    read from its file by this client, layer by layer, and verified before use
    (``kvflow.pool.diskread``); one that fails its checks is a failed chunk, and the pool is
    told to delete it.

    The pool evicts a prefix's tail before its head, and takes context
    (the ``*_with_context`` calls; a server of an earlier release that does not is sent the plain
    calls).

    Concurrency: every method is thread-safe. Metadata calls share one connection and take one
    lock (a round trip each); ``batch_copy`` takes no lock across the copy and runs on several
    threads at once, without the GIL. ``close()`` closes the connection (the server releases
    this client's sessions) after copies in flight have finished.
    """

    inline_metadata = False
    device_memory = frozenset({"cpu", "cuda"})
    saves_in_memory = True  # into the mapped arena; only loads may read the disk tier

    def __init__(self, config: SharedStoreConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise InvalidArgumentError("options", sorted(options), "give a config or options")
        self.config = config or SharedStoreConfig.from_dict(options)
        self._native_copy = NATIVE
        self._regions = LocalRegions()
        self._link = PoolLink(self.config)
        self._disk = DiskReads()
        self._disk_sessions: dict[int, list[int]] = {}  # read session -> its disk objects
        try:
            with self._link.lock:
                self._link.connected()
        except StoreUnavailableError as exc:
            log.warning("kvflow: shared pool unavailable for now: %s", exc)

    @property
    def socket_path(self) -> str:
        return self.config.socket

    @property
    def _conn(self) -> PoolConnection | None:
        """The live connection, if any (the link's; for tests and diagnostics)."""
        return self._link.conn

    @property
    def reconnects(self) -> int:
        """How many connections this store has made (the first one included)."""
        return self._link.reconnects

    # -- the Store interface ------------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._regions.register(regions)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        return self.lookup_with_context(keys, ())

    def lookup_with_context(self, keys: Sequence[str], context: Sequence[str]) -> np.ndarray:
        keys, context = tuple(keys), tuple(context)
        with self._link.lock:
            ctx = (p.Op.LOOKUP_CTX, p.keys_context_body(keys, context)) if context else None
            _, code, body = self._link.call(p.Op.LOOKUP, p.encode_keys(keys), ctx=ctx)
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
        with self._link.lock:
            ctx = None
            if context:
                ctx = (p.Op.OPEN_WRITE_CTX, p.open_write_context_body(keys, n, context))
            conn, code, body = self._link.call(p.Op.OPEN_WRITE, p.open_write_body(keys, n), ctx=ctx)
            self._expect_ok(code, body, "open_write")
            handle, offsets, sizes, status = p.parse_session(body, len(keys))
            granted = status == WriteStatus.GRANTED
            addrs = np.where(granted, offsets + conn.base, 0)
            local = self._link.add(
                ClientSession(
                    conn, handle, True, addrs[granted], addrs[granted] + sizes[granted], math.inf
                )
            )
        return WriteSession(local, keys, addrs, status.astype(np.int8))

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        ok = np.asarray(ok, dtype=bool)
        if ok.shape != (len(session.keys),):
            raise InvalidArgumentError("ok", ok.shape, f"expected {len(session.keys)} flags")
        with self._link.lock:
            s = self._link.pop(session.handle)
            if s is None:
                return
            code, _ = self._link.end(s, p.Op.FINISH_WRITE, p.finish_write_body(s.server_handle, ok))
            if code != p.Code.OK:
                raise StoreError(f"finish_write: the pool did not commit ({code.name})", int(code))

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        return self.open_read_with_context(keys, ())

    def open_read_with_context(self, keys: Sequence[str], context: Sequence[str]) -> ReadSession:
        keys, context = tuple(keys), tuple(context)
        with self._link.lock:
            sent = time.monotonic()
            ctx = (p.Op.OPEN_READ_CTX, p.keys_context_body(keys, context)) if context else None
            conn, code, body = self._link.call(p.Op.OPEN_READ, p.encode_keys(keys), ctx=ctx)
            self._expect_ok(code, body, "open_read")
            handle, offsets, sizes, flags = p.parse_session(body, len(keys))
            leased = flags == 1
            addrs = np.where(leased, offsets + conn.base, 0)
            ttl = conn.hello.lease_ttl_ms / 1000
            deadline = sent + ttl * (1 - _LEASE_MARGIN)
            local = self._link.add(
                ClientSession(
                    conn, handle, False, addrs[leased], addrs[leased] + sizes[leased], deadline
                )
            )
        found = leased.copy()
        if conn.disk_root and (flags == p.ON_DISK).any():  # files: outside the link's lock
            on_disk = np.flatnonzero(flags == p.ON_DISK).tolist()
            opened = []
            for i, base in zip(
                on_disk, self._disk.open(conn.disk_root, [keys[i] for i in on_disk]), strict=True
            ):
                if base is not None:
                    addrs[i], found[i] = base, True
                    opened.append(base)
            self._disk_sessions[local] = opened
        return ReadSession(local, keys, addrs, found)

    def close_read(self, session: ReadSession) -> None:
        self._disk.close(self._disk_sessions.pop(session.handle, ()))
        with self._link.lock:
            self._drop_bad()
            s = self._link.pop(session.handle)
            if s is None:
                return
            code, _ = self._link.end(s, p.Op.CLOSE_READ, p.handle_body(s.server_handle))
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
        on_disk = self._disk.tagged(pool_addrs) if reading else None
        if on_disk is None:
            return self._copy(pool_addrs, local_addrs, sizes, reading)
        disk, arena = np.flatnonzero(on_disk), np.flatnonzero(~on_disk)
        staged = self._disk.stage(pool_addrs[disk], sizes[disk])  # read and verified first
        ok = staged.ok
        extra = (local_addrs[disk][ok], staged.src[ok], sizes[disk][ok])
        failed = self._copy(pool_addrs[arena], local_addrs[arena], sizes[arena], True, extra)
        return np.sort(np.concatenate([arena[failed], disk[~ok]]))

    def prepare_writes(
        self, layers: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]
    ) -> ArenaWrites | None:
        """Every layer's copies of a save, checked now, all at once (``kvflow.pool.prepared``):
        raises as ``batch_copy`` would for bad input, and StoreUnavailableError while
        disconnected. No I/O: one short hold of the link's copy lock."""
        return ArenaWrites.prepare(self._link, self._regions, layers, self._native_copy)

    def _copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        reading: bool,
        extra: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Copy arena ranges; ``extra``: (dst, src, sizes) copied in the same call (staged
        disk bytes: one call, as a CUDA device's copy allows). The arena ranges that failed."""
        with self._link.copying(pool_addrs, sizes, reading) as (conn, held, deadline):
            if conn.peer_gone():
                held[:] = False
            dst, src = (local_addrs, pool_addrs) if reading else (pool_addrs, local_addrs)
            if not held.all():
                dst, src, sizes = dst[held], src[held], sizes[held]
            if extra is not None:
                pairs = zip((dst, src, sizes), extra, strict=True)
                dst, src, sizes = (np.concatenate(pair) for pair in pairs)
            if len(sizes):
                copy_ranges(dst, src, sizes, native=self._native_copy)
        lost = self._link.conn is not conn
        if reading and (lost or time.monotonic() >= deadline or conn.peer_gone()):
            held[:] = False  # the leases must still hold now that the bytes are in
        failed: np.ndarray = np.flatnonzero(~held)
        return failed

    def usage(self) -> StoreUsage:
        stats = self.server_stats()
        return StoreUsage(**{f.name: stats[f.name] for f in fields(StoreUsage)})

    def contents_epoch(self) -> object:
        """The instance of the server last connected to (a restarted one has another)."""
        conn = self._link.conn
        return None if conn is None else conn.hello.instance

    def server_stats(self) -> dict[str, int]:
        """Every counter the server keeps (``kvflow.pool.protocol.STATS_FIELDS``). After
        ``close()`` this asks over a connection of its own."""
        with self._link.lock:
            if self._link.closed:
                return query_stats(self.config.socket, self.config.timeout_s)
            _, code, body = self._link.call(p.Op.STATS)
            self._expect_ok(code, body, "stats")
            return p.parse_stats(body)

    def close(self) -> None:
        """Close the connection once the copies in flight are out (the server then releases
        this client's sessions); later calls raise ClosedError."""
        self._link.close()
        for opened in list(self._disk_sessions.values()):
            self._disk.close(opened)
        self._disk_sessions.clear()

    @property
    def disk_reads(self) -> DiskReads:
        """The disk tier's objects this client reads itself, and their counters."""
        return self._disk

    def _drop_bad(self) -> None:
        """Tell the pool which disk objects failed this client's checks (best effort). Holds
        the link's lock."""
        bad = self._disk.take_bad()
        conn = self._link.conn
        if bad and conn is not None and conn.features & p.Feature.DISK:
            with contextlib.suppress(KVFlowError):
                self._link.call(p.Op.DISK_DROP, p.encode_keys(tuple(bad)), retry=False)

    def __repr__(self) -> str:
        link = self._link
        return (
            f"SharedStore(socket={self.config.socket!r}, connected={link.conn is not None}, "
            f"sessions={len(link.sessions)}, in_flight={link.in_flight}, "
            f"reconnects={link.reconnects}, closed={link.closed})"
        )

    @staticmethod
    def _expect_ok(code: p.Code, body: bytes, what: str) -> None:
        if code == p.Code.INVALID_ARGUMENT:
            raise InvalidArgumentError(what, body.decode("utf-8", "replace"), "refused by the pool")
        if code != p.Code.OK:
            raise StoreError(
                f"{what}: pool replied {code.name}: {body.decode('utf-8', 'replace')}", int(code)
            )
