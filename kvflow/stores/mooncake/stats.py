"""MooncakeStats: what a MooncakeStore did, counted (not assumed): its calls to the master
and its ranged transfers, the copies read from its own segment, and Mooncake's refusals, by
kind and by code. ``sessions_api`` and ``local_endpoint`` say which modes run; the sessions,
pending writes and leases open are counted when ``stats()`` is called.

Concurrency: a plain dataclass. The store changes its own under its ``_lock``; ``stats()``
answers a copy taken under that lock, which no later call changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MooncakeStats"]


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
    late_sessions: int = 0  # sessions started by a call answered after its timeout (then ended)
    open_sessions: int = 0  # read and write sessions open in this store now
    pending_writes: int = 0  # objects this store is writing (put sessions open)
    leases: int = 0  # objects held by this store's read sessions (one per session and key)
    codes: dict[int, int] = field(default_factory=dict)  # native error code -> times seen
