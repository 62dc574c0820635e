"""MooncakeSessions: a MooncakeStore's sessions at the master, and Mooncake's codes translated.

The half of MooncakeStore that talks to the master about sessions (its Store calls, in
store.py, decide when):

- ``_open``: a session registered here, a slot and a virtual pool address for each of its
  objects (``kvflow.stores.mooncake.slots``); ``_forget`` frees them when the session ends;
- ``_start_puts``: put sessions started; a lease conflict (a reader still holds an old copy)
  is retried once, 10 ms later;
- ``_start_gets``: get sessions started; Mooncake keeps one per key and client, so read
  sessions here sharing a key share it (reference counts);
- ``_late_started`` / ``_end_late``: a session start that timed out here may still reach the
  master (a master coming back answers the client's retries). The sessions such a late
  answer started are ended before the next session start (or at close): a put session
  nobody finishes would keep its key from being written again, and a get session nobody
  reads would hold a lease;
- ``_commit``: put sessions ended (without the session calls: the staged objects put whole,
  ``kvflow.stores.mooncake.legacy``);
- ``_map_local``: which objects of a read session lie in this process's own segment, read
  there until ``local_read_window_s`` has passed (local reads);
- ``_count`` and ``_unavailable_if_down``: codes counted (no space, exists, the odd ones by
  code), and an unreachable master told from a bad key: RPC errors, or a failing
  ``health_check``, raise StoreUnavailableError.

Concurrency: the Store calls hold ``_meta_lock`` around these (``lookup`` calls
``_unavailable_if_down`` without it); each takes ``_lock`` briefly, for slots and counters,
never across a call to the master.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvflow.errors import StoreError, StoreUnavailableError
from kvflow.stores.mooncake.client import (
    EXISTS,
    HAS_LEASE,
    NO_SPACE,
    NOT_FOUND,
    NOT_READY,
    OK,
    RPC_FAIL,
    in_segment,
)
from kvflow.stores.mooncake.config import MooncakeConfig
from kvflow.stores.mooncake.legacy import whole_objects
from kvflow.stores.mooncake.slots import Session, SlotTable, address
from kvflow.stores.mooncake.stats import MooncakeStats
from kvflow.stores.native import NativeStore

__all__ = ["MooncakeSessions"]

log = logging.getLogger("kvflow")


class MooncakeSessions(NativeStore[MooncakeStats, Session]):
    """The sessions half of MooncakeStore; see the module docstring. The store sets
    ``config``, ``_replicate`` (the ``ReplicateConfig`` it puts with) and ``_slots``."""

    config: MooncakeConfig
    _replicate: Any
    _slots: SlotTable

    def __init__(self, stats: MooncakeStats, key_prefix: str, timeout_s: float) -> None:
        super().__init__(stats, key_prefix, timeout_s)
        self._late_puts: set[str] = set()  # put sessions late answers started (ended next)
        self._late_gets: set[str] = set()  # get sessions, the same

    def _open(
        self, keys: tuple[str, ...], granted: np.ndarray, writing: bool, nbytes: int
    ) -> tuple[int, np.ndarray]:
        """Register a session; slots (and virtual addresses) for its granted keys."""
        addrs = np.zeros(len(keys), dtype=np.int64)
        session = Session(keys, {}, writing, nbytes)
        with self._lock:
            for pos in np.flatnonzero(granted).tolist():
                slot = self._slots.take(keys[pos], writing)
                session.slots[pos] = slot
                addrs[pos] = address(slot)
            handle = self._add_session(session)
        return handle, addrs

    def _forget(self, handle: int, session: Session) -> None:
        for slot in session.slots.values():
            self._slots.release(slot)

    def _start_puts(self, keys: list[str], sizes: list[int]) -> np.ndarray:
        self._end_late()
        codes = np.asarray(
            self._meta(
                "batch_put_session_start",
                keys,
                sizes,
                self._replicate,
                on_late=self._late_started(keys, self._late_puts),
            ),
            dtype=np.int64,
        )
        conflict = np.flatnonzero(codes == HAS_LEASE)
        if conflict.size:  # another reader holds a lease on an old copy: one retry
            with self._lock:
                self._stats.lease_conflicts += int(conflict.size)
            time.sleep(0.01)
            retried = [keys[i] for i in conflict]
            again = self._meta(
                "batch_put_session_start",
                retried,
                [sizes[i] for i in conflict],
                self._replicate,
                on_late=self._late_started(retried, self._late_puts),
            )
            codes[conflict] = np.asarray(again, dtype=np.int64)
        if (codes < 0).any():
            self._unavailable_if_down(codes, "open_write", missing=(EXISTS, NO_SPACE, HAS_LEASE))
        return codes

    def _start_gets(self, keys: tuple[str, ...]) -> np.ndarray:
        """Per key: OK if readable now, else Mooncake's code. Mooncake keeps one get session
        per key and client, so keys this store already reads share it (reference counts)."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        if not self._stats.sessions_api:
            exist = np.asarray(self._meta("batch_is_exist", list(keys)), dtype=np.int64)
            return np.where(exist == 1, OK, np.where(exist == 0, NOT_FOUND, exist))
        self._end_late()
        new = [k for k in dict.fromkeys(keys) if k not in self._reading]
        late = self._late_started(new, self._late_gets)
        started = self._meta("batch_get_session_start", new, on_late=late) if new else []
        code_of = dict(zip(new, (int(c) for c in started), strict=True))
        return np.array([code_of.get(k, OK) for k in keys], dtype=np.int64)

    def _late_started(self, keys: list[str], into: set[str]) -> Callable[[Any], None]:
        """What a start call's late answer does (on a call thread): the keys it started go to
        ``into``, ``_late_puts`` or ``_late_gets``, for ``_end_late``."""

        def late(codes: Any) -> None:
            started = [k for k, code in zip(keys, codes, strict=True) if int(code) == OK]
            with self._lock:
                into.update(started)
                self._stats.late_sessions += len(started)
            if started:
                log.warning(
                    "kvflow: %d Mooncake session(s) started after their call timed out; "
                    "they are ended before the next start",
                    len(started),
                )

        return late

    def _end_late(self) -> None:
        """End the sessions late answers started (holds ``_meta_lock``). A key written or read
        here again meanwhile is left to that session's end; a failed end is tried again."""
        with self._lock:
            puts = [k for k in self._late_puts if k not in self._writing]
            gets = [k for k in self._late_gets if k not in self._reading]
            self._late_puts.clear()
            self._late_gets.clear()
        for name, keys, into in (
            ("batch_put_session_revoke", puts, self._late_puts),
            ("batch_get_session_end", gets, self._late_gets),
        ):
            if keys and self._meta(name, keys, quiet=True) is None:
                with self._lock:
                    into.update(keys)

    def _commit(self, s: Session, positions: list[int]) -> np.ndarray:
        keys = [s.keys[p] for p in positions]
        if self._stats.sessions_api:
            return np.asarray(self._meta("batch_put_session_end", keys), dtype=np.int64)
        codes = np.full(len(keys), -1, dtype=np.int64)
        put, ptrs, sizes = whole_objects([s.pending.get(p, []) for p in positions], s.nbytes)
        if put:
            got = self._meta(
                "batch_put_from_multi_buffers",
                [keys[i] for i in put],
                ptrs,
                sizes,
                self._replicate,
            )
            codes[put] = np.asarray(got, dtype=np.int64)
        return codes

    def _map_local(self, handle: int) -> None:
        """Note which objects of a read session lie in the own segment, and where. The query
        is a master call that also renews the objects' leases; a failure only means the
        session's copies go through the transfer engine."""
        with self._lock:
            s = self._sessions[handle]
            keys = {pos: s.keys[pos] for pos in s.slots}
        until = time.monotonic() + self.config.local_read_window_s
        try:
            replicas = self._meta("batch_get_replica_desc", list(keys.values()))
        except StoreError as exc:
            log.debug("kvflow: no local reads for this session: %s", exc)
            return
        prefix = self.config.key_prefix
        with self._lock:
            for pos, key in keys.items():
                where = in_segment(replicas.get(prefix + key, ()), self._stats.local_endpoint)
                if where is not None and pos in s.slots and handle in self._sessions:
                    self._slots.place(s.slots[pos], where, until)

    def _count(self, codes: np.ndarray, *, writing: bool) -> None:
        expected = (OK, NO_SPACE, EXISTS) if writing else (OK, NOT_FOUND, NOT_READY)
        odd = codes[~np.isin(codes, expected)].tolist()
        with self._lock:
            if writing:
                self._stats.no_space += int((codes == NO_SPACE).sum())
                self._stats.exists += int((codes == EXISTS).sum())
            self._stats.failed_keys += len(odd)
        self._count_codes(odd)

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
            self._unavailable()
            raise StoreUnavailableError(
                f"Mooncake {what}: the master is unreachable", int(errors[0])
            )
