"""MemcacheStats: what a MemcacheStore did, counted (not assumed): its calls to the meta
service and its copy calls (those that failed too), memcache's refusals by kind and by code,
and the ranges failed because their read lease ran out. ``write_finish_api`` says whether
commits are calls of their own (memcache 1.3 on).

Concurrency: a plain dataclass; the store changes it under its ``_lock``. The sessions, pending
writes and leases open are counted when ``stats()`` takes its copy, under that lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MemcacheStats"]


@dataclass
class MemcacheStats:
    """What the store did, counted (not assumed)."""

    write_finish_api: bool = True
    meta_calls: int = 0  # calls that talk to the meta service
    copy_calls: int = 0  # memcache batch_copy calls
    copy_failures: int = 0  # of those, the ones that returned non-zero or raised
    no_space: int = 0
    exists: int = 0
    failed_keys: int = 0
    lease_failures: int = 0  # keys batch_add_lease or batch_remove_lease refused
    expired_leases: int = 0  # ranges failed because their read lease ran past its limit
    unavailable: int = 0  # metadata calls that found memcache unreachable
    open_sessions: int = 0
    pending_writes: int = 0  # objects this store has allocated and not finished
    leases: int = 0  # objects held by this store's read sessions (one per session and key)
    codes: dict[int, int] = field(default_factory=dict)  # native code -> times seen
