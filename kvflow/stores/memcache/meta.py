"""MemcacheMeta: a MemcacheStore's calls to memcache's meta service, their answers translated.

The half of MemcacheStore that asks memcache for objects (its Store calls, in store.py, decide
when):

- ``_allocate``: write grants: present keys EXISTS, the others allocated (``batch_alloc``);
  for a refusal without a reason, whether the key exists now is asked once more;
- ``_finish``: commits and aborts in one ``batch_write_finish`` (without it, memcache before
  1.3: aborts removed, commits need no call);
- ``_lease`` and ``_end_leases``: read leases, the lease taken before the objects' GVAs are
  resolved (``_key_info``); leases of keys found unreadable end at once (unless another
  session here reads them);
- ``_answer``, ``_codes`` and ``_down``: per-key answers; a short one, or a call failing for
  every key, raises StoreUnavailableError.

Refusals are counted by kind (exists, no space, failed keys, lease failures) and by code.

Concurrency: the Store calls hold ``_meta_lock`` around these (``lookup`` calls ``_key_info``
without it); each takes ``_lock`` briefly, for counters, never across a call to memcache.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvflow.errors import StoreError, StoreUnavailableError
from kvflow.stores.base import WriteStatus
from kvflow.stores.memcache.client import (
    DOWN,
    MISSING,
    READABLE,
    WRITE_FAIL,
    WRITE_OK,
    alloc_results,
    key_info,
    native_code,
)
from kvflow.stores.memcache.config import MemcacheConfig
from kvflow.stores.memcache.held import Session
from kvflow.stores.memcache.stats import MemcacheStats
from kvflow.stores.native import NativeStore

__all__ = ["MemcacheMeta"]

log = logging.getLogger("kvflow")


class MemcacheMeta(NativeStore[MemcacheStats, Session]):
    """The meta service half of MemcacheStore; see the module docstring. The store sets
    ``config``."""

    config: MemcacheConfig

    def _allocate(self, keys: list[str], nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """Status and GVA per key: present keys EXISTS, the others allocated where memcache
        gives the memory."""
        exist = self._codes("batch_is_exist", keys)
        if (exist < 0).all():
            self._down("batch_is_exist", exist)
        status = np.where(exist == 1, WriteStatus.EXISTS, WriteStatus.FAILED).astype(np.int8)
        addrs = np.zeros(len(keys), dtype=np.int64)
        absent = np.flatnonzero(exist == 0)
        if absent.size:
            cfg = self.config
            names = [keys[i] for i in absent]
            sizes = [nbytes] * len(names)
            extra = cfg.media_code, cfg.write_lease_ttl_ms
            got, gvas, codes = alloc_results(self._answer("batch_alloc", names, sizes, *extra))
            status[absent], addrs[absent] = got, gvas
            unknown = absent[got == WriteStatus.FAILED]
            if unknown.size:  # memcache answers 0 without a reason: was it another writer?
                again = self._codes("batch_is_exist", [keys[i] for i in unknown], quiet=True)
                status[unknown[again == 1]] = WriteStatus.EXISTS
            self._count_codes(codes[(gvas == 0) & (codes != 0)].tolist())
        with self._lock:
            self._stats.exists += int((status == WriteStatus.EXISTS).sum())
            self._stats.no_space += int((status == WriteStatus.NO_SPACE).sum())
            self._stats.failed_keys += int((status == WriteStatus.FAILED).sum())
        return status, addrs

    def _finish(self, keys: list[str], commit: np.ndarray) -> int:
        """Commit or abort allocated keys; returns how many commits memcache refused."""
        if not self._stats.write_finish_api:
            aborted = [k for k, c in zip(keys, commit.tolist(), strict=True) if not c]
            if aborted:
                self._meta("remove_batch", aborted, quiet=True)
            return 0
        results = [WRITE_OK if c else WRITE_FAIL for c in commit.tolist()]
        codes = self._codes("batch_write_finish", keys, results, quiet=not commit.any())
        refused = codes != 0
        self._count_codes(codes[refused].tolist())
        if (refused & ~commit).any():
            shown = codes[refused & ~commit][:4].tolist()
            log.warning("kvflow: memcache refused to abort objects (codes %s)", shown)
        return int((refused & commit).sum())

    def _lease(self, keys: list[str]) -> dict[str, tuple[int, int]]:
        """Lease ``keys`` and resolve the leased ones: key -> (GVA, size) for every readable
        object. The lease comes first: an object resolved without one could move or go."""
        codes = self._codes("batch_add_lease", keys, self.config.read_lease_ttl_ms)
        if np.isin(codes, DOWN).all():
            self._down("batch_add_lease", codes)
        leased = [k for k, c in zip(keys, codes.tolist(), strict=True) if c == 0]
        refused = codes[(codes != 0) & ~np.isin(codes, MISSING)]
        with self._lock:
            self._stats.lease_failures += int(refused.size)
        self._count_codes(refused.tolist())
        try:
            infos = self._key_info(leased) if leased else []
        except BaseException:
            self._end_leases([k for k in leased if k not in self._reading])
            raise
        where = {k: i for k, i in zip(leased, infos, strict=True) if i is not None}
        self._end_leases([k for k in leased if k not in where and k not in self._reading])
        return where

    def _key_info(self, keys: list[str]) -> list[tuple[int, int] | None]:
        """Per key, the (GVA, size) of a readable object, or None."""
        return [key_info(info) for info in self._answer("batch_get_key_info", keys, READABLE)]

    def _end_leases(self, keys: list[str]) -> None:
        if not keys:
            return
        rc = self._meta("batch_remove_lease", keys, quiet=True)
        if rc != 0:  # memcache ends the lease itself when its time is up
            with self._lock:
                self._stats.lease_failures += len(keys)
            log.warning("kvflow: memcache batch_remove_lease of %d keys: %r", len(keys), rc)

    def _answer(self, name: str, keys: list[str], *extra: Any) -> list[Any]:
        """A per-key answer: one entry per key, or StoreUnavailableError."""
        got = self._meta(name, keys, *extra)
        answer = list(got) if isinstance(got, (list, tuple)) else []
        if len(answer) != len(keys):
            self._unavailable()
            raise StoreUnavailableError(
                f"memcache {name} answered {len(answer)} results for {len(keys)} keys"
            )
        return answer

    def _codes(self, name: str, keys: list[str], *extra: Any, quiet: bool = False) -> np.ndarray:
        """Per-key result codes; ``quiet``: a failed call answers -1 for every key."""
        try:
            got = self._answer(name, keys, *extra)
            return np.array([native_code(c) for c in got], dtype=np.int64)
        except (StoreError, TypeError, ValueError) as exc:
            if not quiet:
                raise
            log.warning("kvflow: memcache %s failed: %s", name, exc)
            return np.full(len(keys), -1, dtype=np.int64)

    def _down(self, name: str, codes: np.ndarray) -> None:
        self._count_codes(codes.tolist())
        self._unavailable()
        raise StoreUnavailableError(f"memcache {name} failed for every key", int(codes[0]))
