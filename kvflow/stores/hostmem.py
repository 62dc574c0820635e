"""How much host memory a new arena may take: a capacity the machine cannot give is refused
before any memory is mapped or faulted (else the arena is filled until the OOM killer comes).

Both arenas take RAM: LocalStore's anonymous memory and the pool server's memfd, which lives in
the kernel's own shmem mount (the size of /dev/shm does not limit it). What may be taken is the
smaller of ``MemAvailable`` in /proc/meminfo and the room left under this process's memory
cgroup limit, where one is set (v2 ``memory.max`` of the cgroup or a parent, v1
``hierarchical_memory_limit``; the cgroup's inactive file cache counts as free, as the kernel
reclaims it first). Where neither can be read (not Linux) nothing is refused.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from kvflow.errors import ConfigError

__all__ = ["HostMemory", "check_capacity", "read_host_memory"]

_NO_LIMIT = 1 << 62  # cgroup v1 writes "unlimited" as a number near 2**63
_HINT = "choose a smaller capacity or free memory"


@dataclass(frozen=True)
class HostMemory:
    """Memory a new arena may take now, and where the figures come from (None: not known)."""

    mem_available: int | None  # MemAvailable in /proc/meminfo
    cgroup_limit: int | None  # the tightest memory cgroup limit over this process
    cgroup_room: int | None  # that limit less what the cgroup uses (its inactive files not)

    @property
    def available(self) -> int | None:
        known = [n for n in (self.mem_available, self.cgroup_room) if n is not None]
        return min(known) if known else None


def check_capacity(
    size: int, given: object, memory: HostMemory | None = None, *, hint: str = _HINT
) -> None:
    """Raise ConfigError (``capacity``, ``given``) if ``size`` bytes exceed what is available
    (``memory``, read now when not given). The message says what was asked, what is available
    and where that figure comes from, then ``hint``: what to do."""
    memory = memory or read_host_memory()
    available = memory.available
    if available is None or size <= available:
        return
    sources = []
    if memory.mem_available is not None:
        sources.append(f"MemAvailable in /proc/meminfo: {_gib(memory.mem_available)}")
    if memory.cgroup_limit is not None and memory.cgroup_room is not None:
        sources.append(
            f"this process's memory cgroup limit {_gib(memory.cgroup_limit)} leaves "
            f"{_gib(memory.cgroup_room)}"
        )
    raise ConfigError(
        "capacity",
        given,
        f"{size:,} bytes ({_gib(size)}) asked, but only {_gib(available)} of memory is "
        f"available ({'; '.join(sources)}); {hint}",
    )


def read_host_memory(proc: str = "/proc", cgroup_mount: str = "/sys/fs/cgroup") -> HostMemory:
    """The figures of this machine now (the paths are parameters for tests)."""
    fields = _key_values(os.path.join(proc, "meminfo"))
    available = fields.get("MemAvailable")
    limit = room = None
    for line in _read(os.path.join(proc, "self", "cgroup")).splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        found = None
        if hierarchy == "0" and controllers == "":
            found = _cgroup_v2(cgroup_mount, path)
        elif "memory" in controllers.split(","):
            found = _cgroup_v1(os.path.join(cgroup_mount, "memory"), path)
        if found is not None and (room is None or found[1] < room):
            limit, room = found
    return HostMemory(
        None if available is None else available * 1024,  # meminfo counts kB
        limit,
        room,
    )


def _cgroup_v2(mount: str, path: str) -> tuple[int, int] | None:
    """(limit, room) of the tightest ``memory.max`` from the cgroup up to the root."""
    best = None
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(mount, *parts[:depth])
        limit = _number(os.path.join(directory, "memory.max"))
        if limit is None:
            continue
        used = _number(os.path.join(directory, "memory.current")) or 0
        cache = _key_values(os.path.join(directory, "memory.stat")).get("inactive_file", 0)
        room = max(limit - max(used - cache, 0), 0)
        if best is None or room < best[1]:
            best = (limit, room)
    return best


def _cgroup_v1(mount: str, path: str) -> tuple[int, int] | None:
    directory = os.path.join(mount, *[p for p in path.split("/") if p])
    if not os.path.isdir(directory):  # a namespaced container sees its own cgroup as the root
        directory = mount
    stat = _key_values(os.path.join(directory, "memory.stat"))
    limits = [
        n
        for n in (
            _number(os.path.join(directory, "memory.limit_in_bytes")),
            stat.get("hierarchical_memory_limit"),
        )
        if n is not None and n < _NO_LIMIT
    ]
    if not limits:
        return None
    used = _number(os.path.join(directory, "memory.usage_in_bytes")) or 0
    cache = stat.get("total_inactive_file", 0)
    return min(limits), max(min(limits) - max(used - cache, 0), 0)


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read()
    return ""


def _number(path: str) -> int | None:
    """A file holding one integer; None if missing, unreadable or ``max`` (no limit)."""
    text = _read(path).strip()
    return int(text) if text.isdigit() else None


def _key_values(path: str) -> dict[str, int]:
    """``key value [unit]`` lines (meminfo, memory.stat) as integers."""
    out = {}
    for line in _read(path).splitlines():
        words = line.replace(":", " ").split()
        if len(words) >= 2 and words[1].isdigit():
            out[words[0]] = int(words[1])
    return out


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
