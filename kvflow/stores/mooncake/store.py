"""MooncakeStore: Mooncake Store, the multi-node pool, behind kvflow's Store interface.

Mooncake addresses objects by key and offset, so the store hands out virtual pool addresses
(``kvflow.stores.mooncake.slots``); ``batch_copy`` turns a layer's ranges back into per-key
lists of (local pointer, size, offset) and makes one ranged call for the whole layer:

    open_write   batch_put_session_start(keys, sizes)     one master round trip per batch
    batch_copy   batch_put_from_multi_buffer_ranges       per layer; no master round trip
    finish_write batch_put_session_end / _revoke          one round trip
    lookup       batch_is_exist                           one round trip
    open_read    batch_get_session_start                  one round trip (replicas cached)
                 (+ batch_get_replica_desc, local reads)  one round trip
    batch_copy   batch_get_into_multi_buffer_ranges       per layer; no master round trip
    close_read   batch_get_session_end                    one round trip

Local reads: a layer's ranges of an object whose replica is in this process's own segment are
copied straight from it by kvflow's copy loop, while the master's lease (taken by the replica
query at ``open_read``) protects it: within ``local_read_window_s`` of the query, after which
they go through the transfer engine again (``kvflow.stores.mooncake.client``).

Without the session calls (older Mooncake), a save puts whole objects at ``finish_write`` and a
load makes one ``get_into_ranges`` call per layer (``kvflow.stores.mooncake.legacy``);
``stats().sessions_api`` says which mode runs.

Errors are translated at the store (the master's codes in ``kvflow.stores.mooncake.sessions``):
a missing key is a miss; "no space" skips the save of that chunk (counted); a lease conflict is
retried once, then fails the chunk; anything else fails the chunks involved, with Mooncake's
code in the log. When calls fail with RPC errors (or
``health_check`` says the master is unreachable), metadata calls raise StoreUnavailableError:
lookups miss and saves are skipped; Mooncake's client reconnects by itself when the master is
back. Ranges already resolved keep working while the master is away when the bytes' owner is
alive (transfers go peer to peer); when they cannot, they fail their chunks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.copying.host import copy_ranges
from kvflow.errors import InvalidArgumentError, StoreError
from kvflow.stores.base import ReadSession, WriteSession, WriteStatus
from kvflow.stores.mooncake.client import (
    EXISTS,
    NOT_FOUND,
    NOT_READY,
    OK,
    SESSION_CALLS,
    mooncake_module,
    own_endpoint,
    setup,
    write_status,
)
from kvflow.stores.mooncake.config import MooncakeConfig
from kvflow.stores.mooncake.legacy import get_ranges, stage
from kvflow.stores.mooncake.sessions import MooncakeSessions
from kvflow.stores.mooncake.slots import MAX_OBJECT_BYTES, VIRTUAL_TAG, SlotTable, decode, plan_copy
from kvflow.stores.mooncake.stats import MooncakeStats
from kvflow.stores.native import BINDING_ERRORS, check_nbytes, check_ok_flags

__all__ = ["VIRTUAL_TAG", "MooncakeStats", "MooncakeStore"]

log = logging.getLogger("kvflow")


class MooncakeStore(MooncakeSessions):
    """A Store on Mooncake Store. ``MooncakeStore(master_server_address="10.0.0.1:50051")``, or
    ``MooncakeStore(MooncakeConfig.from_env())``.

    Concurrency: thread-safe. Metadata calls run on a small thread pool of their own and wait at
    most ``timeout_s``; ``batch_copy`` runs on the caller's thread (the engine bounds it with
    ``copy_timeout_s``) and several may run at once. ``close()`` revokes pending writes, ends
    read sessions (those that start calls answered after their timeout started too) and
    closes the client.
    """

    engine = "Mooncake"

    def __init__(self, config: MooncakeConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise InvalidArgumentError("options", sorted(options), "give a config or options")
        self.config = cfg = config or MooncakeConfig(**options)
        module = mooncake_module()
        self._client = module.MooncakeDistributedStore()
        self._replicate = module.ReplicateConfig()
        self._replicate.replica_num = cfg.replica_num
        api = all(hasattr(self._client, n) for n in SESSION_CALLS)
        super().__init__(MooncakeStats(sessions_api=api), cfg.key_prefix, cfg.timeout_s)
        self._slots = SlotTable()
        try:
            setup(self._client, cfg, self._call)
        except BaseException:
            self._calls.shutdown()
            raise
        if cfg.prefer_local_segment and int(cfg.global_segment_size) > 0:
            self._replicate.preferred_segment = self._client.get_hostname()
        self._stats.local_endpoint = own_endpoint(self._client, cfg, self._call)
        if not self._stats.sessions_api:
            log.warning("kvflow: this Mooncake has no session calls; saves put whole objects")

    # -- the Store interface ------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        keys = list(keys)
        self._check_open()
        if not keys:
            return np.zeros(0, dtype=bool)
        codes = np.asarray(self._meta("batch_is_exist", keys), dtype=np.int64)
        if (codes < 0).any():
            self._unavailable_if_down(codes, "lookup")
        found: np.ndarray = codes == 1
        return found

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        keys = tuple(keys)
        nbytes = check_nbytes(nbytes, MAX_OBJECT_BYTES, "1 TiB")
        self._check_open()
        with self._meta_lock:
            codes = np.full(len(keys), EXISTS, dtype=np.int64)  # pending here, or repeated
            first = self._new_writes(keys)
            new = list(first)
            if new and self._stats.sessions_api:
                codes[list(first.values())] = self._start_puts(new, [nbytes] * len(new))
            elif new:  # fallback: reserve nothing now; whole objects are put at finish_write
                exist = np.asarray(self._meta("batch_is_exist", new), dtype=np.int64)
                codes[list(first.values())] = np.where(exist == 1, EXISTS, OK)
            status = write_status(codes)
            self._count(codes, writing=True)
            granted = status == WriteStatus.GRANTED
            self._writing.update(np.asarray(keys, dtype=object)[granted].tolist())
            handle, addrs = self._open(keys, granted, True, nbytes)
        return WriteSession(handle, keys, addrs, status)

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        ok = check_ok_flags(ok, len(session.keys))
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
                    self._meta("batch_put_session_revoke", keys, quiet=True)
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
                self._read_more(np.asarray(keys, dtype=object)[found].tolist())
            handle, addrs = self._open(keys, found, False, 0)
            if self._stats.local_endpoint and found.any():
                self._map_local(handle)
        return ReadSession(handle, keys, addrs, found)

    def close_read(self, session: ReadSession) -> None:
        with self._meta_lock:
            s = self._close_session(session.handle, writing=False)
            if s is None or not s.slots or not self._stats.sessions_api:
                return
            ended = self._read_less(s.keys[pos] for pos in s.slots)
            if ended:
                self._meta("batch_get_session_end", ended, quiet=True)

    def _batch_copy(
        self, pool_addrs: np.ndarray, local_addrs: np.ndarray, sizes: np.ndarray, writing: bool
    ) -> np.ndarray:
        """A layer's ranges: those of objects in the own segment read straight from it (while
        they may be), the others in one ranged call (``batch_copy``'s checks are NativeStore's)."""
        slots, offsets = decode(pool_addrs, sizes)
        now = time.monotonic()
        with self._lock:  # a slot of a finished session (or the other direction) fails
            held, local = self._slots.resolve(np.unique(slots).tolist(), writing, now)
        failed, direct, sources, groups = plan_copy(slots, offsets, sizes, held, local)
        if direct.size:  # read straight from the own segment (see the module docstring)
            copy_ranges(local_addrs[direct], sources, sizes[direct])
            if direct.size == pool_addrs.size:
                with self._lock:
                    self._stats.local_copies += 1
        if groups:  # one ranged call through the transfer engine for every other key
            results = self._transfer(groups, held, slots, offsets, local_addrs, sizes, writing)
            for g, ok in zip(groups, results, strict=True):
                if not ok:
                    failed[g] = True
        return np.flatnonzero(failed)

    # -- beyond the interface -----------------------------------------------------------------

    @property
    def replicate_config(self) -> Any:
        """The ``ReplicateConfig`` this store puts with."""
        return self._replicate

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._slots.clear()
            late_puts, late_gets = list(self._late_puts), list(self._late_gets)
        with self._meta_lock:  # revoked and ended below, or by Mooncake's own timeouts
            self._writing.clear()
            self._reading.clear()
        writes = [s.keys[p] for s in sessions if s.writing for p in s.slots] + late_puts
        reads = [s.keys[p] for s in sessions if not s.writing for p in s.slots] + late_gets
        if writes and self._stats.sessions_api:
            self._meta("batch_put_session_revoke", writes, quiet=True)
        if reads and self._stats.sessions_api:
            self._meta("batch_get_session_end", reads, quiet=True)
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

    # -- what NativeStore asks of an engine ---------------------------------------------------

    def _register_span(self, addr: int, nbytes: int) -> None:
        rc = self._call("register_buffer", self._client.register_buffer, addr, nbytes)
        if rc != OK:
            raise StoreError(
                f"Mooncake refused to register {nbytes} bytes at {addr:#x} "
                "(overlapping a region registered before?)",
                rc,
            )

    def _unregister_span(self, addr: int, nbytes: int) -> None:
        rc = self._call("unregister_buffer", self._client.unregister_buffer, addr)
        if rc != OK:
            log.warning("kvflow: Mooncake unregister of %#x: code %d", addr, rc)

    def _count_meta(self) -> None:
        self._stats.master_calls += 1

    # -- copies -------------------------------------------------------------------------------

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
        if writing and not self._stats.sessions_api:  # staged; put whole at finish_write
            with self._lock:
                stage(self._sessions.values(), groups, slots, offsets, local, sizes)
            return [True] * len(groups)
        try:
            if writing:
                got = self._client.batch_put_from_multi_buffer_ranges(keys, ptrs, lens, offs)
            elif self._stats.sessions_api:
                got = self._client.batch_get_into_multi_buffer_ranges(keys, ptrs, lens, offs)
            else:
                got = get_ranges(self._client, keys, ptrs, lens, offs)
        except BINDING_ERRORS as exc:
            log.warning("kvflow: a Mooncake transfer raised: %s", exc)
            return [False] * len(groups)
        results = [int(r) == w for r, w in zip(got, want, strict=True)]
        bad = [int(r) for r, ok in zip(got, results, strict=True) if not ok]
        if bad:
            self._count_codes(bad)
            log.warning(
                "kvflow: Mooncake transfer failed for %d keys (codes %s)", len(bad), bad[:4]
            )
        return results
