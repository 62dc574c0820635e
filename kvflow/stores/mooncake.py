"""MooncakeStore: Mooncake Store, the multi-node pool, behind kvflow's Store interface.

Mooncake addresses objects by key and offset, not by address, so the store hands out *virtual*
pool addresses: each object of an open session gets a slot, and ``TAG | slot << 40 | offset``
addresses byte ``offset`` of it (``TAG`` is bit 62, which no host address has, so a host
address passed as a pool address is refused as bad input). ``batch_copy`` turns a layer's
ranges back into per-key lists of (local pointer, size, offset) and makes one ranged call for
the whole layer:

    open_write   batch_put_session_start(keys, sizes)     one master round trip per batch
    batch_copy   batch_put_from_multi_buffer_ranges       per layer; no master round trip
    finish_write batch_put_session_end / _revoke          one round trip
    lookup       batch_is_exist                           one round trip
    open_read    batch_get_session_start                  one round trip (replicas cached)
                 (+ batch_get_replica_desc, local reads)  one round trip
    batch_copy   batch_get_into_multi_buffer_ranges       per layer; no master round trip
    close_read   batch_get_session_end                    one round trip

Local reads: Mooncake's ranged calls go through its transfer engine even when the object lies
in this process's own segment (the usual case on one node: ``prefer_local_segment``). So
``open_read`` also asks for the objects' replicas, and a layer's ranges of an object whose
replica is in this process's segment are copied straight from it by kvflow's copy loop, while
the master's lease (taken by that query) protects it: within ``local_read_window_s`` of the
query, after which they go through the transfer engine again. Which endpoint is this
process's own is learnt once, at setup, by putting a probe object into the own segment and
reading its bytes back at the address the master reports (see ``_own_endpoint``).

Without the session calls (older Mooncake), a save keeps its ranges and puts whole objects at
``finish_write`` (``batch_put_from_multi_buffers``: the local memory must stay unchanged until
then) and a load makes one ``get_into_ranges`` call per layer (a master lookup each);
``stats().sessions_api`` says which mode runs.

Errors are translated here: a missing key is a miss; "no space" skips the save of that chunk
(counted); a lease conflict is retried once, then fails the chunk; anything else fails the
chunks involved, with Mooncake's code in the log. When calls fail with RPC errors (or
``health_check`` says the master is unreachable), metadata calls raise StoreUnavailableError:
lookups miss and saves are skipped; Mooncake's client reconnects by itself when the master is
back. Ranges already resolved keep working while the master is away when the bytes' owner is
alive (transfers go peer to peer); when they cannot, they fail their chunks.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvflow.errors import (
    ClosedError,
    InvalidArgumentError,
    MissingDependencyError,
    StoreError,
    StoreUnavailableError,
)
from kvflow.stores.base import Direction, ReadSession, Store, WriteSession, WriteStatus
from kvflow.stores.calls import BoundedCalls
from kvflow.stores.copyloop import copy_ranges
from kvflow.stores.mooncake_config import MooncakeConfig
from kvflow.stores.regions import LocalRegions

__all__ = ["VIRTUAL_TAG", "MooncakeStats", "MooncakeStore"]

log = logging.getLogger("kvflow")

SLOT_SHIFT = 40  # objects up to 1 TiB
VIRTUAL_TAG = 1 << 62
_OFFSET_MASK = (1 << SLOT_SHIFT) - 1
_MAX_SLOTS = (1 << 22) - 1  # slot bits 40..61; the all-ones slot is never handed out

OK = 0
NO_SPACE = -200  # NO_AVAILABLE_HANDLE
NOT_READY = -703  # REPLICA_IS_NOT_READY: still being written
NOT_FOUND = -704  # OBJECT_NOT_FOUND
EXISTS = -705  # OBJECT_ALREADY_EXISTS
HAS_LEASE = -706  # OBJECT_HAS_LEASE
RPC_FAIL = -900
_SESSION_CALLS = (
    "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
)


@dataclass
class MooncakeStats:
    """What the store did, counted (not assumed)."""

    sessions_api: bool = True
    master_calls: int = 0  # calls that talk to the master (metadata)
    copy_calls: int = 0  # ranged transfer calls (no master round trip in session mode)
    local_copies: int = 0  # batch_copy calls whose ranges were all read from the own segment
    local_endpoint: str = ""  # this process's segment, when local reads are on and it has one
    no_space: int = 0
    exists: int = 0
    lease_conflicts: int = 0
    failed_keys: int = 0
    unavailable: int = 0  # metadata calls refused because the master was unreachable
    open_sessions: int = 0  # read and write sessions open in this store now
    pending_writes: int = 0  # objects this store is writing (put sessions open)
    leases: int = 0  # objects held by this store's read sessions (one per session and key)
    codes: dict[int, int] = field(default_factory=dict)  # native error code -> times seen


@dataclass(eq=False)
class _Session:
    keys: tuple[str, ...]
    slots: dict[int, int]  # position in keys -> slot, for the objects copied through
    writing: bool
    nbytes: int = 0
    pending: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # fallback


class MooncakeStore(Store):
    """A Store on Mooncake Store. ``MooncakeStore(master_server_address="10.0.0.1:50051")``, or
    ``MooncakeStore(MooncakeConfig.from_env())``.

    Concurrency: thread-safe. Metadata calls run on a small thread pool of their own and wait at
    most ``timeout_s``; ``batch_copy`` runs on the caller's thread (the engine bounds it with
    ``copy_timeout_s``) and several may run at once. ``close()`` revokes pending writes, ends
    read sessions and closes the client.
    """

    inline_metadata = False

    def __init__(self, config: MooncakeConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise InvalidArgumentError("options", sorted(options), "give a config or options")
        self.config = config or MooncakeConfig(**options)
        module = _mooncake()
        self._client = module.MooncakeDistributedStore()
        self._replicate = module.ReplicateConfig()
        self._replicate.replica_num = self.config.replica_num
        self._calls = BoundedCalls("Mooncake", self.config.timeout_s, self._timed_out)
        self._lock = threading.Lock()  # slots and counters (taken by copies)
        self._meta_lock = threading.RLock()  # session starts and ends, in order
        self._reading: dict[str, int] = {}  # key -> open read sessions sharing its get session
        self._writing: set[str] = set()  # keys with a put session open here
        self._stats = MooncakeStats(
            sessions_api=all(hasattr(self._client, n) for n in _SESSION_CALLS)
        )
        self._slots: dict[int, tuple[str, bool]] = {}  # slot -> (key, writing)
        self._free: list[int] = []
        self._next_slot = 0
        self._sessions: dict[int, _Session] = {}
        self._handles = itertools.count(1)
        self._regions = LocalRegions()
        self._registered: dict[tuple[int, int], int] = {}  # span -> registrations
        self._local: dict[int, tuple[int, int, float]] = {}  # slot -> (address, size, until)
        self._closed = False
        cfg = self.config
        try:
            rc = self._call(
                "setup",
                self._client.setup,
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.global_segment_size,
                cfg.local_buffer_size,
                cfg.protocol,
                cfg.device_name,
                cfg.master_server_address,
            )
        except BaseException:
            self._calls.shutdown()
            raise
        if rc != OK:
            self._calls.shutdown()
            raise StoreUnavailableError(
                f"Mooncake setup with master {cfg.master_server_address} failed", rc
            )
        if cfg.prefer_local_segment and int(cfg.global_segment_size) > 0:
            self._replicate.preferred_segment = self._client.get_hostname()
        self._stats.local_endpoint = self._own_endpoint()
        if not self._stats.sessions_api:
            log.warning("kvflow: this Mooncake has no session calls; saves put whole objects")

    # -- the Store interface ------------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        with self._meta_lock:
            for addr, nbytes in regions:
                span = (int(addr), int(nbytes))
                if span not in self._registered:
                    rc = self._call("register_buffer", self._client.register_buffer, *span)
                    if rc != OK:
                        raise StoreError(
                            f"Mooncake refused to register {nbytes} bytes at {addr:#x} "
                            "(overlapping a region registered before?)",
                            rc,
                        )
                self._registered[span] = self._registered.get(span, 0) + 1
            self._regions.register(regions)

    def unregister(self, regions: Sequence[tuple[int, int]]) -> None:
        with self._meta_lock:
            for addr, nbytes in regions:
                span = (int(addr), int(nbytes))
                users = self._registered.get(span, 0)
                if users > 1:
                    self._registered[span] = users - 1
                elif users == 1:
                    del self._registered[span]
                    rc = self._call("unregister_buffer", self._client.unregister_buffer, addr)
                    if rc != OK:
                        log.warning("kvflow: Mooncake unregister of %#x: code %d", addr, rc)
            self._regions = LocalRegions()
            self._regions.register(list(self._registered))

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        keys = list(keys)
        self._check_open()
        if not keys:
            return np.zeros(0, dtype=bool)
        codes = np.asarray(self._master("batch_is_exist", keys), dtype=np.int64)
        if (codes < 0).any():
            self._unavailable_if_down(codes, "lookup")
        found: np.ndarray = codes == 1
        return found

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        keys = tuple(keys)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
            raise InvalidArgumentError("nbytes", nbytes, "must be an integer >= 1")
        if nbytes > _OFFSET_MASK:
            raise InvalidArgumentError("nbytes", nbytes, "objects are limited to 1 TiB")
        self._check_open()
        with self._meta_lock:
            codes = np.full(len(keys), EXISTS, dtype=np.int64)  # pending here, or repeated
            first = {}
            for i, key in enumerate(keys):
                if key not in self._writing and key not in first:
                    first[key] = i
            new = list(first)
            if new and self._stats.sessions_api:
                codes[list(first.values())] = self._start_puts(new, [int(nbytes)] * len(new))
            elif new:  # fallback: reserve nothing now; whole objects are put at finish_write
                exist = np.asarray(self._master("batch_is_exist", new), dtype=np.int64)
                codes[list(first.values())] = np.where(exist == 1, EXISTS, OK)
            status = np.full(len(keys), WriteStatus.FAILED, dtype=np.int8)
            status[codes == OK] = WriteStatus.GRANTED
            status[codes == EXISTS] = WriteStatus.EXISTS
            status[codes == NO_SPACE] = WriteStatus.NO_SPACE
            self._count(codes, writing=True)
            granted = status == WriteStatus.GRANTED
            self._writing.update(np.asarray(keys, dtype=object)[granted].tolist())
            handle, addrs = self._open(keys, granted, True, int(nbytes))
        return WriteSession(handle, keys, addrs, status)

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        ok = np.asarray(ok, dtype=bool)
        if ok.shape != (len(session.keys),):
            raise InvalidArgumentError("ok", ok.shape, f"expected {len(session.keys)} flags")
        with self._meta_lock:
            s = self._close_session(session.handle, writing=True)
            if s is None:
                return
            commit = [p for p in s.slots if ok[p]]
            revoke = [p for p in s.slots if not ok[p]]
            failed = 0
            try:
                if commit:
                    codes = self._commit(s, commit)
                    failed = int((codes != OK).sum())
                    self._count(codes, writing=True)
                if revoke and self._stats.sessions_api:
                    keys = [s.keys[p] for p in revoke]
                    self._master("batch_put_session_revoke", keys, quiet=True)
            finally:
                self._writing.difference_update(s.keys[p] for p in s.slots)
        if failed:
            raise StoreError(f"finish_write: {failed} of {len(commit)} objects not committed")

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        keys = tuple(keys)
        self._check_open()
        with self._meta_lock:
            codes = self._start_gets(keys)
            if (codes < 0).any():
                self._unavailable_if_down(codes, "open_read", missing=(NOT_FOUND, NOT_READY))
            self._count(codes, writing=False)
            found = codes == OK
            if self._stats.sessions_api:
                for key in np.asarray(keys, dtype=object)[found].tolist():
                    self._reading[key] = self._reading.get(key, 0) + 1
            handle, addrs = self._open(keys, found, False, 0)
            if self._stats.local_endpoint and found.any():
                self._map_local(handle)
        return ReadSession(handle, keys, addrs, found)

    def close_read(self, session: ReadSession) -> None:
        with self._meta_lock:
            s = self._close_session(session.handle, writing=False)
            if s is None or not s.slots or not self._stats.sessions_api:
                return
            ended = []
            for pos in s.slots:
                key = s.keys[pos]
                self._reading[key] -= 1
                if self._reading[key] == 0:
                    del self._reading[key]
                    ended.append(key)
            if ended:
                self._master("batch_get_session_end", ended, quiet=True)

    def _start_gets(self, keys: tuple[str, ...]) -> np.ndarray:
        """Per key: OK if readable now, else Mooncake's code. Mooncake keeps one get session
        per key and client, so keys this store already reads share it (reference counts)."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        if not self._stats.sessions_api:
            exist = np.asarray(self._master("batch_is_exist", list(keys)), dtype=np.int64)
            return np.where(exist == 1, OK, np.where(exist == 0, NOT_FOUND, exist))
        new = [k for k in dict.fromkeys(keys) if k not in self._reading]
        started = self._master("batch_get_session_start", new) if new else []
        code_of = dict(zip(new, (int(c) for c in started), strict=True))
        return np.array([code_of.get(k, OK) for k in keys], dtype=np.int64)

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        self._regions.check_call(pool_addrs, local_addrs, sizes, direction)
        if self._closed:
            raise ClosedError("MooncakeStore")
        if pool_addrs.size == 0:
            return np.zeros(0, dtype=np.int64)
        slots = (pool_addrs & ~VIRTUAL_TAG) >> SLOT_SHIFT
        offsets = pool_addrs & _OFFSET_MASK
        bad = ((pool_addrs & VIRTUAL_TAG) == 0) | (pool_addrs < 0) | (slots >= _MAX_SLOTS)
        bad |= sizes > _OFFSET_MASK + 1 - offsets  # past the largest object: wraps
        if bad.any():
            shown = hex(int(pool_addrs[bad][0]))
            raise InvalidArgumentError("pool_addrs", shown, "not an address this store handed out")
        writing = direction == Direction.TO_POOL
        unique, inverse = np.unique(slots, return_inverse=True)
        held: dict[int, str] = {}  # slot -> key, for slots of open sessions of this direction
        base = np.zeros(unique.size, dtype=np.int64)  # per slot: address in the own segment
        room = np.zeros(unique.size, dtype=np.int64)  # and the object's size there
        now = time.monotonic()
        with self._lock:  # a slot of a finished session (or the other direction) fails
            for i, slot in enumerate(unique.tolist()):
                owner = self._slots.get(slot)
                if owner is None or owner[1] != writing:
                    continue
                held[slot] = owner[0]
                where = None if writing else self._local.get(slot)
                if where is not None and now < where[2]:
                    base[i], room[i] = where[0], where[1]
        known = np.array([slot in held for slot in unique.tolist()], dtype=bool)
        failed = ~known[inverse]
        direct = (base[inverse] != 0) & (sizes <= room[inverse] - offsets)
        if direct.any():  # read straight from the own segment (see the module docstring)
            d = np.flatnonzero(direct)
            copy_ranges(local_addrs[d], base[inverse[d]] + offsets[d], sizes[d])
            if d.size == pool_addrs.size:
                with self._lock:
                    self._stats.local_copies += 1
        rest = np.flatnonzero(~failed & ~direct)
        if rest.size:  # one ranged call through the transfer engine for every other key
            order = rest[np.argsort(slots[rest], kind="stable")]
            groups = np.split(order, np.flatnonzero(np.diff(slots[order])) + 1)
            results = self._transfer(groups, held, slots, offsets, local_addrs, sizes, writing)
            for g, ok in zip(groups, results, strict=True):
                if not ok:
                    failed[g] = True
        return np.flatnonzero(failed)

    def _map_local(self, handle: int) -> None:
        """Note which objects of a read session lie in the own segment, and where. The query
        is a master call that also renews the objects' leases; a failure only means the
        session's copies go through the transfer engine."""
        with self._lock:
            s = self._sessions[handle]
            keys = {pos: s.keys[pos] for pos in s.slots}
        until = time.monotonic() + self.config.local_read_window_s
        try:
            replicas = self._master("batch_get_replica_desc", list(keys.values()))
        except StoreError as exc:
            log.debug("kvflow: no local reads for this session: %s", exc)
            return
        prefix = self.config.key_prefix
        with self._lock:
            for pos, key in keys.items():
                where = _in_segment(replicas.get(prefix + key, ()), self._stats.local_endpoint)
                if where is not None and pos in s.slots and handle in self._sessions:
                    self._local[s.slots[pos]] = (*where, until)

    def _own_endpoint(self) -> str:
        """The transfer endpoint of this process's own segment ("" when local reads are off,
        there is no own segment, or it cannot be told). A probe object is put with the own
        segment preferred; the endpoint of its replica is the own one only if its address lies
        in readable memory of this process and holds the probe's random bytes there."""
        cfg = self.config
        if not cfg.local_reads or int(cfg.global_segment_size) == 0:
            return ""
        if not hasattr(self._client, "batch_get_replica_desc"):
            return ""
        probe = os.urandom(4096)
        key = f"{cfg.key_prefix}kvflow-probe/{probe[:8].hex()}"
        config = _mooncake().ReplicateConfig()
        config.replica_num = 1
        config.preferred_segment = self._client.get_hostname()
        try:
            if self._call("put", self._client.put, key, probe, config) != OK:
                return ""
            try:
                replicas = self._call(
                    "batch_get_replica_desc", self._client.batch_get_replica_desc, [key]
                )
            finally:
                self._call("batch_remove", self._client.batch_remove, [key], True)
        except StoreError as exc:
            log.debug("kvflow: Mooncake local reads off: %s", exc)
            return ""
        for replica in replicas.get(key, ()):
            if not replica.is_memory_replica():
                continue
            buf = replica.get_memory_descriptor().buffer_descriptor
            addr, size = int(buf.buffer_address), int(buf.size)
            if (
                size == len(probe)
                and _readable(addr, size)
                and ctypes.string_at(addr, size) == probe
            ):
                return str(buf.transport_endpoint)
        return ""

    @property
    def client(self) -> Any:
        """The ``MooncakeDistributedStore`` underneath, for calls kvflow does not wrap (and
        same-client references in benchmarks). Keys written through it bypass ``key_prefix``."""
        return self._client

    @property
    def replicate_config(self) -> Any:
        """The ``ReplicateConfig`` this store puts with."""
        return self._replicate

    def stats(self) -> MooncakeStats:
        """A copy of the counters."""
        with self._lock:
            return replace(
                self._stats,
                codes=dict(self._stats.codes),
                open_sessions=len(self._sessions),
                pending_writes=len(self._writing),
                leases=sum(len(s.slots) for s in self._sessions.values() if not s.writing),
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._slots.clear()
            self._local.clear()
        with self._meta_lock:  # revoked and ended below, or by Mooncake's own timeouts
            self._writing.clear()
            self._reading.clear()
        writes = [s.keys[p] for s in sessions if s.writing for p in s.slots]
        reads = [s.keys[p] for s in sessions if not s.writing for p in s.slots]
        if writes and self._stats.sessions_api:
            self._master("batch_put_session_revoke", writes, quiet=True)
        if reads and self._stats.sessions_api:
            self._master("batch_get_session_end", reads, quiet=True)
        try:
            self._call("close", self._client.close)
        except StoreError as exc:
            log.warning("kvflow: closing the Mooncake client: %s", exc)
        self._calls.shutdown()

    def __repr__(self) -> str:
        return (
            f"MooncakeStore(master={self.config.master_server_address!r}, "
            f"sessions={len(self._sessions)}, sessions_api={self._stats.sessions_api}, "
            f"local_reads={self._stats.local_endpoint or 'off'}, "
            f"closed={self._closed})"
        )

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("MooncakeStore")

    def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the store's call threads, waiting at most ``timeout_s``."""
        return self._calls.call(name, fn, *args)

    def _timed_out(self) -> None:
        with self._lock:
            self._stats.unavailable += 1

    def _master(self, name: str, keys: list[str], *extra: Any, quiet: bool = False) -> Any:
        """One metadata call (a master round trip). ``quiet``: a failure is logged, not raised
        (releasing sessions: Mooncake's own leases end them anyway)."""
        with self._lock:
            self._stats.master_calls += 1
        prefix = self.config.key_prefix
        named = [prefix + k for k in keys] if prefix else keys
        try:
            return self._call(name, getattr(self._client, name), named, *extra)
        except StoreError as exc:
            if not quiet:
                raise
            log.warning("kvflow: Mooncake %s failed: %s", name, exc)
            return None

    def _start_puts(self, keys: list[str], sizes: list[int]) -> np.ndarray:
        codes = np.asarray(
            self._master("batch_put_session_start", keys, sizes, self._replicate), dtype=np.int64
        )
        conflict = np.flatnonzero(codes == HAS_LEASE)
        if conflict.size:  # another reader holds a lease on an old copy: one retry
            with self._lock:
                self._stats.lease_conflicts += int(conflict.size)
            time.sleep(0.01)
            again = self._master(
                "batch_put_session_start",
                [keys[i] for i in conflict],
                [sizes[i] for i in conflict],
                self._replicate,
            )
            codes[conflict] = np.asarray(again, dtype=np.int64)
        if (codes < 0).any():
            self._unavailable_if_down(codes, "open_write", missing=(EXISTS, NO_SPACE, HAS_LEASE))
        return codes

    def _commit(self, s: _Session, positions: list[int]) -> np.ndarray:
        keys = [s.keys[p] for p in positions]
        if self._stats.sessions_api:
            return np.asarray(self._master("batch_put_session_end", keys), dtype=np.int64)
        ptrs, sizes, whole = [], [], []
        for p in positions:
            ranges = sorted(s.pending.get(p, []))  # (offset, local, size)
            ends = np.cumsum([r[2] for r in ranges]) if ranges else np.zeros(0)
            starts = [r[0] for r in ranges]
            whole.append(
                bool(ranges) and starts == [0, *ends[:-1].tolist()] and ends[-1] == s.nbytes
            )
            ptrs.append([r[1] for r in ranges])
            sizes.append([r[2] for r in ranges])
        codes = np.full(len(keys), -1, dtype=np.int64)
        put = [i for i, w in enumerate(whole) if w]
        if put:
            got = self._master(
                "batch_put_from_multi_buffers",
                [keys[i] for i in put],
                [ptrs[i] for i in put],
                [sizes[i] for i in put],
                self._replicate,
            )
            codes[put] = np.asarray(got, dtype=np.int64)
        return codes

    def _transfer(
        self,
        groups: list[np.ndarray],
        held: dict[int, str],
        slots: np.ndarray,
        offsets: np.ndarray,
        local: np.ndarray,
        sizes: np.ndarray,
        writing: bool,
    ) -> list[bool]:
        """One ranged call for every key of a layer; per group, whether it moved whole."""
        keys = [self.config.key_prefix + held[int(slots[g[0]])] for g in groups]
        ptrs = [local[g].tolist() for g in groups]
        lens = [sizes[g].tolist() for g in groups]
        offs = [offsets[g].tolist() for g in groups]
        want = [int(sizes[g].sum()) for g in groups]
        with self._lock:
            self._stats.copy_calls += 1
        if writing and not self._stats.sessions_api:
            return self._stage(groups, slots, offsets, local, sizes)
        try:
            if writing:
                got = self._client.batch_put_from_multi_buffer_ranges(keys, ptrs, lens, offs)
            elif self._stats.sessions_api:
                got = self._client.batch_get_into_multi_buffer_ranges(keys, ptrs, lens, offs)
            else:
                got = self._get_ranges(keys, ptrs, lens, offs)
        except (RuntimeError, ValueError, TypeError) as exc:
            log.warning("kvflow: a Mooncake transfer raised: %s", exc)
            return [False] * len(groups)
        results = [int(r) == w for r, w in zip(got, want, strict=True)]
        bad = [int(r) for r, ok in zip(got, results, strict=True) if not ok]
        if bad:
            with self._lock:
                for code in bad:
                    self._stats.codes[code] = self._stats.codes.get(code, 0) + 1
            log.warning(
                "kvflow: Mooncake transfer failed for %d keys (codes %s)", len(bad), bad[:4]
            )
        return results

    def _get_ranges(
        self, keys: list[str], ptrs: list[list[int]], lens: list[list[int]], offs: list[list[int]]
    ) -> list[int]:
        """Fallback load of one layer: ``get_into_ranges`` relative to the lowest address."""
        base = min(min(p) for p in ptrs)
        dst = [[p - base for p in group] for group in ptrs]
        got = self._client.get_into_ranges([base], [keys], [dst], [offs], [lens])
        return [
            sum(int(x) for x in per_key) if all(int(x) >= 0 for x in per_key) else -1
            for per_key in got[0]
        ]

    def _stage(
        self,
        groups: list[np.ndarray],
        slots: np.ndarray,
        offsets: np.ndarray,
        local: np.ndarray,
        sizes: np.ndarray,
    ) -> list[bool]:
        """Fallback save: remember the ranges; ``finish_write`` puts whole objects."""
        with self._lock:
            for g in groups:
                slot = int(slots[g[0]])
                for s in self._sessions.values():
                    for pos, sl in s.slots.items():
                        if sl == slot:
                            s.pending.setdefault(pos, []).extend(
                                zip(
                                    offsets[g].tolist(),
                                    local[g].tolist(),
                                    sizes[g].tolist(),
                                    strict=True,
                                )
                            )
        return [True] * len(groups)

    def _open(
        self, keys: tuple[str, ...], granted: np.ndarray, writing: bool, nbytes: int
    ) -> tuple[int, np.ndarray]:
        """Register a session; slots (and virtual addresses) for its granted keys."""
        addrs = np.zeros(len(keys), dtype=np.int64)
        with self._lock:
            handle = next(self._handles)
            session = _Session(keys, {}, writing, nbytes)
            for pos in np.flatnonzero(granted).tolist():
                slot = self._slot(keys[pos], writing)
                session.slots[pos] = slot
                addrs[pos] = VIRTUAL_TAG | slot << SLOT_SHIFT
            self._sessions[handle] = session
        return handle, addrs

    def _slot(self, key: str, writing: bool) -> int:
        if self._free:
            slot = self._free.pop()
        elif self._next_slot < _MAX_SLOTS:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        else:
            raise StoreError(f"more than {_MAX_SLOTS} objects open at once")
        self._slots[slot] = (key, writing)
        return slot

    def _close_session(self, handle: int, *, writing: bool) -> _Session | None:
        with self._lock:
            s = self._sessions.get(handle)
            if s is None or s.writing != writing:
                if self._closed:
                    return None
                raise InvalidArgumentError("session", handle, "unknown or already finished session")
            del self._sessions[handle]
            for slot in s.slots.values():
                del self._slots[slot]
                self._local.pop(slot, None)
                self._free.append(slot)
        return s

    def _count(self, codes: np.ndarray, *, writing: bool) -> None:
        with self._lock:
            st = self._stats
            if writing:
                st.no_space += int((codes == NO_SPACE).sum())
                st.exists += int((codes == EXISTS).sum())
            expected = (OK, NO_SPACE, EXISTS) if writing else (OK, NOT_FOUND, NOT_READY)
            for code in codes[~np.isin(codes, expected)].tolist():
                st.codes[code] = st.codes.get(code, 0) + 1
                st.failed_keys += 1

    def _unavailable_if_down(
        self, codes: np.ndarray, what: str, missing: tuple[int, ...] = ()
    ) -> None:
        """Raise StoreUnavailableError when errors mean the master is away, not a bad key."""
        errors = codes[(codes < 0) & ~np.isin(codes, missing)]
        if errors.size == 0:
            return
        down = bool((errors == RPC_FAIL).any())
        if not down:
            health = self._call("health_check", self._client.health_check)
            down = health != OK
        if down:
            with self._lock:
                self._stats.unavailable += 1
            raise StoreUnavailableError(
                f"Mooncake {what}: the master is unreachable", int(errors[0])
            )


def _in_segment(replicas: Any, endpoint: str) -> tuple[int, int] | None:
    """(address, size) of a complete in-memory replica at ``endpoint``, if there is one."""
    complete = _mooncake().ReplicaStatus.COMPLETE
    for replica in replicas:
        if not replica.is_memory_replica() or replica.status != complete:
            continue
        buf = replica.get_memory_descriptor().buffer_descriptor
        if str(buf.transport_endpoint) == endpoint:
            return int(buf.buffer_address), int(buf.size)
    return None


def _readable(addr: int, size: int) -> bool:
    """Whether [addr, addr + size) lies in one readable mapping of this process."""
    try:
        with open("/proc/self/maps", encoding="ascii") as maps:
            for line in maps:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= addr and addr + size <= hi:
                    return perms.startswith("r")
    except OSError:
        return False
    return False


def _mooncake() -> Any:
    try:
        import mooncake.store as module
    except ImportError as exc:
        raise MissingDependencyError("MooncakeStore", "'kvflow[mooncake]'") from exc
    return module
