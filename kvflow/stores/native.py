"""What the stores on a native pool client (Mooncake's, memcache's) share.

A native client is a C++ binding that names objects by key, blocks without a time limit of its
own and answers with codes. ``NativeStore`` keeps the bookkeeping both stores do around it, so
that each store's module holds only what its engine does differently:

- every client call on the store's call threads, bounded by ``timeout_s`` (``_call``); a call
  past it counts as ``unavailable``;
- metadata calls with ``key_prefix`` applied and counted (``_meta``), quiet ones logging a
  failure instead of raising (releasing sessions: the engine's own leases end them anyway);
- registered local regions counted per span (``register`` / ``unregister``): the engine hears
  of a span once, however many layouts share it;
- ``batch_copy``'s checks (the arrays, the direction, local ranges inside registered memory,
  the store open) before the engine's copy (``_batch_copy``), and an empty copy answered;
- the open sessions, the keys being written here (never allocated twice) and the keys read here
  (read sessions sharing one key share its native session or lease, counted);
- the counters (a dataclass of the store's own) and their snapshot, ``stats()``.

Concurrency: ``_lock`` guards the sessions and counters (copies take it); ``_meta_lock`` orders
the metadata calls that start and end sessions, and guards ``_writing``, ``_reading`` and the
registrations. ``_meta_lock`` is taken before ``_lock``, never after.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np

from kvflow.errors import ClosedError, InvalidArgumentError, StoreError
from kvflow.stores.base import Direction, Store
from kvflow.stores.calls import BoundedCalls
from kvflow.stores.regions import LocalRegions

__all__ = ["BINDING_ERRORS", "NativeStore", "check_nbytes", "check_ok_flags"]

log = logging.getLogger("kvflow")

BINDING_ERRORS = (RuntimeError, ValueError, TypeError)  # what a native binding raises


class NativeStats(Protocol):
    """The counters every native store keeps (its stats dataclass has more)."""

    unavailable: int
    open_sessions: int
    pending_writes: int
    leases: int
    codes: dict[int, int]


class NativeSession(Protocol):
    """An open read or write session of a native store."""

    keys: tuple[str, ...]
    writing: bool

    @property
    def objects(self) -> int:
        """How many objects the session holds (granted writes, or reads under a lease)."""


StatsT = TypeVar("StatsT", bound=NativeStats)
SessionT = TypeVar("SessionT", bound=NativeSession)


class NativeStore(Store, Generic[StatsT, SessionT]):
    """The shared half of a store on a native client; see the module docstring. A subclass
    sets ``engine`` (its name in messages), makes its client, then calls ``__init__``."""

    inline_metadata = False
    engine: ClassVar[str]
    _client: Any

    def __init__(self, stats: StatsT, key_prefix: str, timeout_s: float) -> None:
        self._calls = BoundedCalls(self.engine, timeout_s, self._unavailable)
        self._lock = threading.Lock()  # sessions and counters (taken by copies)
        self._meta_lock = threading.RLock()  # session starts and ends, in order
        self._stats = stats
        self._key_prefix = key_prefix
        self._sessions: dict[int, SessionT] = {}
        self._handles = itertools.count(1)
        self._writing: set[str] = set()  # keys with a write pending here
        self._reading: dict[str, int] = {}  # key -> read sessions here sharing it
        self._regions = LocalRegions()
        self._registered: dict[tuple[int, int], int] = {}  # span -> registrations
        self._closed = False

    # -- what each engine does ----------------------------------------------------------------

    @abstractmethod
    def _register_span(self, addr: int, nbytes: int) -> None:
        """Register a span with the client (the first registration of it); raise StoreError
        if the client refuses."""

    @abstractmethod
    def _unregister_span(self, addr: int, nbytes: int) -> None:
        """Unregister a span (its last registration went); a refusal is logged."""

    @abstractmethod
    def _batch_copy(
        self, pool_addrs: np.ndarray, local_addrs: np.ndarray, sizes: np.ndarray, writing: bool
    ) -> np.ndarray:
        """``batch_copy`` of at least one range, its arguments checked (``writing``: to the
        pool); the indexes of the ranges that failed."""

    @abstractmethod
    def _count_meta(self) -> None:
        """Count one metadata call (holds ``_lock``)."""

    @abstractmethod
    def _forget(self, handle: int, session: SessionT) -> None:
        """Release what a finished session held in this process (holds ``_lock``)."""

    # -- registered regions -------------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        with self._meta_lock:
            for addr, nbytes in regions:
                span = (int(addr), int(nbytes))
                if span not in self._registered:
                    self._register_span(*span)
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
                    self._unregister_span(*span)
            self._regions = LocalRegions()
            self._regions.register(list(self._registered))

    # -- copies -------------------------------------------------------------------------------

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        self._regions.check_call(pool_addrs, local_addrs, sizes, direction)
        self._check_open()
        if pool_addrs.size == 0:
            return np.zeros(0, dtype=np.int64)
        return self._batch_copy(pool_addrs, local_addrs, sizes, direction == Direction.TO_POOL)

    # -- counters -----------------------------------------------------------------------------

    def stats(self) -> StatsT:
        """A copy of the counters."""
        with self._lock:
            snapshot = copy.copy(self._stats)
            snapshot.codes = dict(self._stats.codes)
            snapshot.open_sessions = len(self._sessions)
            snapshot.pending_writes = len(self._writing)
            snapshot.leases = sum(s.objects for s in self._sessions.values() if not s.writing)
            return snapshot

    def _unavailable(self) -> None:
        with self._lock:
            self._stats.unavailable += 1

    def _count_codes(self, codes: Iterable[int]) -> None:
        with self._lock:
            for code in codes:
                self._stats.codes[code] = self._stats.codes.get(code, 0) + 1

    # -- calls --------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The native client underneath, for calls kvflow does not wrap (keys written through
        it bypass ``key_prefix``)."""
        return self._client

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(type(self).__name__)

    def _call(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        on_late: Callable[[Any], object] | None = None,
    ) -> Any:
        """``fn(*args)`` on the store's call threads, waiting at most ``timeout_s``;
        ``on_late`` gets what it returns if that comes after the wait ended."""
        return self._calls.call(name, fn, *args, on_late=on_late)

    def _meta(
        self,
        name: str,
        keys: list[str],
        *extra: Any,
        quiet: bool = False,
        on_late: Callable[[Any], object] | None = None,
    ) -> Any:
        """One metadata call, the client's ``name`` on ``keys`` with ``key_prefix`` applied.
        ``quiet``: a failure is logged and answers None, not raised. ``on_late``: see
        ``_call``."""
        with self._lock:
            self._count_meta()
        prefix = self._key_prefix
        named = [prefix + k for k in keys] if prefix else keys
        try:
            return self._call(name, getattr(self._client, name), named, *extra, on_late=on_late)
        except StoreError as exc:
            if not quiet:
                raise
            log.warning("kvflow: %s %s failed: %s", self.engine, name, exc)
            return None

    # -- sessions -----------------------------------------------------------------------------

    def _add_session(self, session: SessionT) -> int:
        """A handle for a new open session (holds ``_lock``)."""
        handle = next(self._handles)
        self._sessions[handle] = session
        return handle

    def _close_session(self, handle: int, *, writing: bool) -> SessionT | None:
        """Remove an open session of this direction; None after close() (a no-op then).
        Raises for an unknown one."""
        with self._lock:
            s = self._sessions.get(handle)
            if s is None or s.writing != writing:
                if self._closed:
                    return None
                raise InvalidArgumentError("session", handle, "unknown or already finished session")
            del self._sessions[handle]
            self._forget(handle, s)
        return s

    def _new_writes(self, keys: Sequence[str]) -> dict[str, int]:
        """Key -> position, for the first of each key not being written here already (the rest
        count as existing). Holds ``_meta_lock``."""
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            if key not in self._writing and key not in first:
                first[key] = i
        return first

    def _read_more(self, keys: Iterable[str]) -> None:
        """One more read session here on each of ``keys``. Holds ``_meta_lock``."""
        for key in keys:
            self._reading[key] = self._reading.get(key, 0) + 1

    def _read_less(self, keys: Iterable[str]) -> list[str]:
        """One read session fewer on each of ``keys``; returns those no session here reads any
        more (their native session or lease ends now). Holds ``_meta_lock``."""
        ended = []
        for key in keys:
            self._reading[key] -= 1
            if self._reading[key] == 0:
                del self._reading[key]
                ended.append(key)
        return ended


def check_nbytes(nbytes: Any, limit: int, limit_text: str) -> int:
    """A write's object size: an integer from 1 to ``limit`` (``limit_text`` says it)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
        raise InvalidArgumentError("nbytes", nbytes, "must be an integer >= 1")
    if nbytes > limit:
        raise InvalidArgumentError("nbytes", nbytes, f"objects are limited to {limit_text}")
    return int(nbytes)


def check_ok_flags(ok: Any, count: int) -> np.ndarray:
    """``finish_write``'s flags: one bool per key of the session."""
    flags = np.asarray(ok, dtype=bool)
    if flags.shape != (count,):
        raise InvalidArgumentError("ok", flags.shape, f"expected {count} flags")
    return flags
