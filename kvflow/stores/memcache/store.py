"""MemcacheStore: Ascend MemFabric's memcache (``memcache_hybrid``) behind kvflow's Store interface.

Memcache hands out global virtual addresses (GVAs): an object is one range of a pool that spans
every node, and ``batch_copy`` moves bytes between GVAs and local memory with no metadata. So
kvflow's pool addresses are memcache's own GVAs, resolved once per request batch:

    lookup       batch_get_key_info(keys, READABLE)        one meta round trip
    open_write   batch_is_exist, batch_alloc(absent keys)  two (three when an allocation failed)
    batch_copy   batch_copy(gvas, ptrs, sizes, H2G|L2G)    per layer; no metadata
    finish_write batch_write_finish(keys, results)         one: commits and aborts together
    open_read    batch_add_lease, batch_get_key_info       two: the lease first, then the GVAs
    batch_copy   batch_copy(gvas, ptrs, sizes, G2H|G2L)    per layer; no metadata
    close_read   batch_remove_lease                        one (keys no other session here reads)

Memcache's own rules the store keeps: ``batch_alloc`` is not idempotent (a key is allocated
once; this store remembers the keys it is writing and never allocates one twice); an object is
readable only after ``batch_write_finish`` (a failed result removes it); a process holds one
read lease per key (``batch_add_lease`` again renews it, one ``batch_remove_lease`` ends it), so
read sessions sharing a key share the lease (reference counts). A copy only ever touches a GVA
range this store holds: a granted write, or an object under a read lease that has not run past
``read_lease_ttl_ms`` (checked before and after the copy; ``kvflow.stores.memcache.held``);
anything else is refused.

Where the binding has no ``batch_write_finish`` (memcache before 1.3), objects are readable
from allocation: commits need no call, aborts remove the object (``remove_batch``), other
processes may see an object before all its layers are in, and ``stats().write_finish_api`` is
false (a warning says so). Native codes are translated at the store (the meta service's in
``kvflow.stores.memcache.meta``): a key already stored is EXISTS, no memory is NO_SPACE, other
refusals fail their chunks; a call that fails for every key, a short answer, or a call past
``timeout_s`` raises StoreUnavailableError.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvflow.errors import InvalidArgumentError, StoreError
from kvflow.stores.base import ReadSession, WriteSession, WriteStatus
from kvflow.stores.memcache.client import (
    MAX_KEY_BYTES,
    copy_directions,
    copy_in_batches,
    native_code,
    start_client,
)
from kvflow.stores.memcache.config import MemcacheConfig
from kvflow.stores.memcache.held import HeldRanges, Session, lease_deadline
from kvflow.stores.memcache.meta import MemcacheMeta
from kvflow.stores.memcache.stats import MemcacheStats
from kvflow.stores.native import check_nbytes, check_ok_flags

__all__ = ["MemcacheStats", "MemcacheStore"]

log = logging.getLogger("kvflow")


class MemcacheStore(MemcacheMeta):
    """A Store on Ascend memcache. ``MemcacheStore(meta_service_url="tcp://10.0.0.1:5000",
    config_store_url="tcp://10.0.0.1:6000", device_id=0)``, or
    ``MemcacheStore(MemcacheConfig.from_env())``.

    ``client``: an already set-up and initialised memcache client (a
    ``memcache_hybrid.DistributedObjectStore``, or a stand-in in tests) to use instead of
    making one; it stays the caller's (``close()`` leaves it open). Memcache keeps one client
    per process, so one MemcacheStore per process.

    Concurrency: thread-safe. Metadata calls run one at a time on the store's call threads and
    wait at most ``timeout_s``; ``batch_copy`` runs on the caller's thread, several at once.
    ``close()`` waits for copies in flight, aborts pending writes, ends leases and closes the
    client the store made.
    """

    engine = "memcache"

    def __init__(
        self, config: MemcacheConfig | None = None, *, client: Any = None, **options: Any
    ) -> None:
        if config is not None and options:
            raise InvalidArgumentError("options", sorted(options), "give a config or options")
        self.config = cfg = config or MemcacheConfig(**options)
        self._owns_client = client is None
        self._client = client if client is not None else start_client(cfg)
        finish_api = callable(getattr(self._client, "batch_write_finish", None))
        super().__init__(MemcacheStats(write_finish_api=finish_api), cfg.key_prefix, cfg.timeout_s)
        self._to_pool, self._from_pool = copy_directions(cfg.local_memory)
        self.device_memory = frozenset({"cpu" if cfg.local_memory == "host" else "npu"})
        self._cond = threading.Condition(self._lock)  # copies in flight
        self._held = HeldRanges()
        self._in_flight = 0
        if not self._stats.write_finish_api:
            log.warning(
                "kvflow: this memcache has no batch_write_finish; other processes may see "
                "objects before all their layers are in"
            )

    # -- the Store interface ------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        keys = list(keys)
        self._check_keys(keys)
        if not keys:
            return np.zeros(0, dtype=bool)
        found = np.array([r is not None for r in self._key_info(keys)], dtype=bool)
        with self._meta_lock:  # pending here: readable only once finished (old memcache)
            found &= np.array([k not in self._writing for k in keys], dtype=bool)
        return found

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        keys = tuple(keys)
        nbytes = check_nbytes(nbytes, (1 << 48) - 1, "256 TiB")
        self._check_keys(keys)
        status = np.full(len(keys), WriteStatus.EXISTS, dtype=np.int8)  # pending here, repeated
        addrs = np.zeros(len(keys), dtype=np.int64)
        with self._meta_lock:
            self._check_open()
            first = self._new_writes(keys)
            if first:
                pos = np.fromiter(first.values(), dtype=np.int64, count=len(first))
                status[pos], addrs[pos] = self._allocate(list(first), nbytes)
            granted = np.flatnonzero(status == WriteStatus.GRANTED)
            self._writing.update(keys[i] for i in granted)
            starts = addrs[granted]
            handle = self._open(Session(keys, granted, True), starts, starts + nbytes, math.inf)
        return WriteSession(handle, keys, addrs, status)

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        ok = check_ok_flags(ok, len(session.keys))
        with self._meta_lock:
            s = self._close_session(session.handle, writing=True)
            if s is None or s.held.size == 0:
                return
            keys = [s.keys[i] for i in s.held]
            try:
                failed = self._finish(keys, ok[s.held])
            finally:
                self._writing.difference_update(keys)
        if failed:
            raise StoreError(f"finish_write: memcache did not commit {failed} objects")

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        keys = tuple(keys)
        self._check_keys(keys)
        found = np.zeros(len(keys), dtype=bool)
        addrs = np.zeros(len(keys), dtype=np.int64)
        ends = np.zeros(len(keys), dtype=np.int64)
        with self._meta_lock:
            self._check_open()
            unique = list(dict.fromkeys(k for k in keys if k not in self._writing))
            started = time.monotonic()
            where = self._lease(unique) if unique else {}
            for i, key in enumerate(keys):
                info = where.get(key)
                if info is not None:
                    found[i], addrs[i], ends[i] = True, info[0], info[0] + info[1]
            deadline = lease_deadline(started, self.config.read_lease_ttl_ms)
            held = np.flatnonzero(found)
            self._read_more(keys[i] for i in held)
            handle = self._open(Session(keys, held, False), addrs[held], ends[held], deadline)
        return ReadSession(handle, keys, addrs, found)

    def close_read(self, session: ReadSession) -> None:
        with self._meta_lock:
            s = self._close_session(session.handle, writing=False)
            if s is None:
                return
            self._end_leases(self._read_less(s.keys[i] for i in s.held))

    def _batch_copy(
        self, pool_addrs: np.ndarray, local_addrs: np.ndarray, sizes: np.ndarray, writing: bool
    ) -> np.ndarray:
        """A layer's ranges, each inside an object this store holds (``held``), in memcache
        calls of bounded size; read leases checked again once the bytes are in
        (``batch_copy``'s checks are NativeStore's)."""
        reading = not writing
        with self._cond:
            self._check_open()  # again under the lock: close() waits for the copies it counts
            now = time.monotonic()
            failed = ~self._held.check(pool_addrs, sizes, reading, now, strict=True)
            self._stats.expired_leases += int(failed.sum())
            self._in_flight += 1
        try:
            todo = np.flatnonzero(~failed)
            if todo.size:
                ok = self._copy(pool_addrs[todo], local_addrs[todo], sizes[todo], reading)
                failed[todo[~ok]] = True
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
        if reading:  # the leases must still hold now that the bytes are in
            with self._cond:
                now = time.monotonic()
                lost = ~failed & ~self._held.check(pool_addrs, sizes, True, now, strict=False)
                self._stats.expired_leases += int(lost.sum())
            failed |= lost
        result: np.ndarray = np.flatnonzero(failed)
        return result

    # -- beyond the interface -----------------------------------------------------------------

    def close(self) -> None:
        with self._meta_lock:
            with self._cond:
                if self._closed:
                    return
                self._closed = True
                self._cond.wait_for(lambda: self._in_flight == 0, timeout=self.config.timeout_s)
                self._sessions.clear()
                self._held.clear()
            writes, reads = sorted(self._writing), sorted(self._reading)
            self._writing.clear()
            self._reading.clear()
            if writes:
                self._finish(writes, np.zeros(len(writes), dtype=bool))
            self._end_leases(reads)
        if self._owns_client:
            self._quiet("close", self._client.close)
        self._calls.shutdown()

    def __repr__(self) -> str:
        source = self.config.local_config_path or self.config.meta_service_url
        return (
            f"MemcacheStore(meta={source!r}, device={self.config.device_id}, "
            f"sessions={len(self._sessions)}, in_flight={self._in_flight}, closed={self._closed})"
        )

    # -- what NativeStore asks of an engine ---------------------------------------------------

    def _register_span(self, addr: int, nbytes: int) -> None:
        if not self.config.register_buffers:
            return
        rc = self._call("register_buffer", self._client.register_buffer, addr, nbytes)
        if rc != 0:
            where = f"{nbytes} bytes at {addr:#x}"
            raise StoreError(f"memcache refused to register {where}", native_code(rc))

    def _unregister_span(self, addr: int, nbytes: int) -> None:
        if self.config.register_buffers:
            self._quiet("unregister_buffer", self._client.unregister_buffer, addr, nbytes)

    def _count_meta(self) -> None:
        self._stats.meta_calls += 1

    def _forget(self, handle: int, session: Session) -> None:
        self._held.remove(handle, session.writing)

    # -- sessions and copies ------------------------------------------------------------------

    def _check_keys(self, keys: Sequence[str]) -> None:
        self._check_open()
        room = MAX_KEY_BYTES - len(self.config.key_prefix.encode())
        for key in keys:
            if not isinstance(key, str) or len(key.encode()) > room:
                why = f"memcache keys are strings of at most {MAX_KEY_BYTES} bytes with key_prefix"
                raise InvalidArgumentError("keys", key, why)

    def _open(self, s: Session, starts: np.ndarray, ends: np.ndarray, deadline: float) -> int:
        with self._lock:
            handle = self._add_session(s)
            self._held.add(handle, s.writing, starts, ends, deadline)
        return handle

    def _copy(
        self, pool: np.ndarray, local: np.ndarray, sizes: np.ndarray, reading: bool
    ) -> np.ndarray:
        """The ranges in memcache batch_copy calls of bounded size; per range, whether it moved."""
        direct = self._from_pool if reading else self._to_pool
        cfg = self.config
        limits = cfg.max_copy_batch, int(cfg.max_copy_bytes)
        ok, calls, bad = copy_in_batches(self._client, direct, pool, local, sizes, *limits)
        with self._lock:
            self._stats.copy_calls += calls
            self._stats.copy_failures += len(bad)
        self._count_codes(rc for rc in bad if isinstance(rc, int))
        if bad:
            log.warning("kvflow: %d memcache batch_copy calls failed (%s)", len(bad), bad[:4])
        return ok

    def _quiet(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """A client call whose failure (an error, or an answer other than 0) is only logged."""
        try:
            rc = self._call(name, fn, *args)
        except StoreError as exc:
            rc = exc
        if rc != 0:
            log.warning("kvflow: memcache %s: %r", name, rc)
