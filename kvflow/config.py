"""Configuration: frozen dataclasses validated on construction, sizes accepted as "8GiB"."""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, TypeVar

from kvflow.errors import ConfigError

__all__ = [
    "DEFAULT_CHUNK_BLOCKS",
    "DEFAULT_COPY_TIMEOUT_S",
    "DEFAULT_MAX_TRANSFER_BYTES",
    "DEFAULT_OP_TIMEOUT_S",
    "DEFAULT_PREFETCH_LAYERS",
    "DEFAULT_SAVE_BACKLOG",
    "EngineConfig",
    "cpu_list",
    "from_dict",
    "parse_size",
    "server_cpus",
    "spare_cpus",
]

DEFAULT_CHUNK_BLOCKS = 4
DEFAULT_PREFETCH_LAYERS = 2
DEFAULT_SAVE_BACKLOG = 4
DEFAULT_COPY_THREADS = 1
DEFAULT_MAX_TRANSFER_BYTES = 64 << 20
DEFAULT_COPY_TIMEOUT_S = 10.0
DEFAULT_OP_TIMEOUT_S = 30.0

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, argument: str = "size") -> int:
    """Bytes from an int or a string such as ``"8GiB"``, ``"512 MiB"``, ``"2GB"`` or ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers
    of 1000. Raises ConfigError naming ``argument`` for anything else, or a negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(argument, value, "expected a byte count or a size such as '8GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(argument, value, "must not be negative")
        return value
    if not isinstance(value, str):
        raise ConfigError(argument, value, "expected a byte count or a size such as '8GiB'")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            argument, value, "expected a size such as '8GiB', '512MiB', '2GB' or '4096'"
        )
    size = Fraction(match.group(1)) * _UNITS[unit]
    if size.denominator != 1:
        raise ConfigError(argument, value, "is not a whole number of bytes")
    if size >= 1 << 63:
        raise ConfigError(argument, value, "is too large (at most 2**63 - 1 bytes)")
    return int(size)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "must be an integer >= 1")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(name, value, "must be a number of seconds > 0")
    if not math.isfinite(value):
        raise ConfigError(name, value, "must be finite")


@dataclass(frozen=True)
class EngineConfig:
    """How a TransferEngine keys, batches, paces and times its transfers.

    Fields:
        model: model name; part of every key's namespace.
        rank: this process's tensor-parallel rank; part of every key.
        chunk_blocks: blocks per pool object (one key per chunk, all layers inside).
        prefetch_layers: a load copies at most this many layers ahead of the consumer.
        save_backlog: a save holds at most this many written-but-not-copied layers; the
            producer waits in ``layer_written`` beyond that.
        copy_threads: threads of the copy executor.
        copy_cpus: CPUs the copy threads pin themselves to (empty: no pinning).
        max_transfer_bytes: coalesced ranges above this are split (accepts "64MiB").
        copy_timeout_s: one layer's copy may take this long before its chunks are failed.
        op_timeout_s: a store metadata call, or a whole-request wait, may take this long.
    """

    model: str = "default"
    rank: int = 0
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS
    prefetch_layers: int = DEFAULT_PREFETCH_LAYERS
    save_backlog: int = DEFAULT_SAVE_BACKLOG
    copy_threads: int = DEFAULT_COPY_THREADS
    copy_cpus: tuple[int, ...] = ()
    max_transfer_bytes: int | str = DEFAULT_MAX_TRANSFER_BYTES
    copy_timeout_s: float = DEFAULT_COPY_TIMEOUT_S
    op_timeout_s: float = DEFAULT_OP_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError("model", self.model, "must be a non-empty string")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("rank", self.rank, "must be an integer >= 0")
        for name in ("chunk_blocks", "prefetch_layers", "save_backlog", "copy_threads"):
            _positive_int(name, getattr(self, name))
        self._check_cpus()
        size = parse_size(self.max_transfer_bytes, argument="max_transfer_bytes")
        if size < 1:
            raise ConfigError("max_transfer_bytes", self.max_transfer_bytes, "must be >= 1 byte")
        object.__setattr__(self, "max_transfer_bytes", size)
        _positive_float("copy_timeout_s", self.copy_timeout_s)
        _positive_float("op_timeout_s", self.op_timeout_s)

    def _check_cpus(self) -> None:
        cpus: Any = self.copy_cpus
        if isinstance(cpus, (str, bytes)) or not hasattr(cpus, "__iter__"):
            raise ConfigError("copy_cpus", cpus, "must be a sequence of CPU numbers")
        cpus = tuple(cpus)
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cpus):
            raise ConfigError("copy_cpus", cpus, "CPU numbers must be integers >= 0")
        available = _available_cpus()
        missing = sorted(set(cpus) - available) if available else []
        if missing:
            raise ConfigError("copy_cpus", cpus, f"CPUs {missing} are not online")
        object.__setattr__(self, "copy_cpus", cpus)

    @property
    def transfer_limit(self) -> int:
        """``max_transfer_bytes`` as an int (it is normalised in ``__post_init__``)."""
        return int(self.max_transfer_bytes)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from a plain dict; unknown keys are an error that lists the known ones."""
        values = dict(values)
        if values.get("copy_cpus") is not None:
            values["copy_cpus"] = tuple(values["copy_cpus"])
        return from_dict(cls, values)


C = TypeVar("C")


def from_dict(cls: type[C], values: dict[str, Any]) -> C:
    """The config dataclass ``cls`` from a plain dict; unknown keys are a ConfigError that
    lists the known ones (every field is then validated by the class itself)."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError("config", unknown, f"unknown keys; known keys are {sorted(known)}")
    return cls(**values)


def _available_cpus() -> set[int]:
    """CPUs a thread of this process may be pinned to: those online, with the process's own
    affinity (which a parent may have narrowed: an inference server binds its workers to the
    compute cores, and the copy threads then go to another one). Empty off Linux."""
    try:
        cpus = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux: no pinning check possible
        return set()
    return cpus | _cpu_list_file("/sys/devices/system/cpu/online")


def spare_cpus() -> tuple[int, ...]:
    """CPUs for copy threads beside a model whose threads an inference server bound to some
    cores (vLLM's CPU worker binds each of its OpenMP threads to one): the CPUs of the parent
    process's affinity (the server's own set, a ``taskset`` included) that no thread of this
    process is bound to, online, in this process's cgroup and on the NUMA nodes of the bound
    ones. Empty where no thread is bound to fewer CPUs (nothing to keep off), where none is
    left, or off Linux. Reads ``/proc`` and ``/sys`` (a few files per thread)."""
    try:
        parent = set(os.sched_getaffinity(os.getppid()))
        tids = os.listdir("/proc/self/task")
    except (AttributeError, OSError):
        return ()
    threads = []
    for tid in tids:
        try:
            threads.append(set(os.sched_getaffinity(int(tid))))
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    nodes = [_cpu_list_file(path) for path in glob.glob("/sys/devices/system/node/node*/cpulist")]
    return _spare(
        parent, threads, _cpu_list_file("/sys/devices/system/cpu/online"), _cgroup_cpus(), nodes
    )


def server_cpus() -> tuple[int, ...]:
    """CPUs for a process this one starts to serve others (an auto-started pool server): the
    spare ones (``spare_cpus``) beside a model bound to some cores, else the parent process's
    affinity. Without this it would inherit the starting thread's affinity: in vLLM's CPU
    worker that is one compute core, where the pool's replies then wait behind the model's
    threads. Empty off Linux (leave the affinity as inherited)."""
    spare = spare_cpus()
    if spare:
        return spare
    try:
        return tuple(sorted(os.sched_getaffinity(os.getppid())))
    except (AttributeError, OSError):
        return ()


def cpu_list(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``: CPU numbers (an argparse ``type``)."""
    values = [s.strip() for s in text.split(",") if s.strip()]
    if not values or not all(v.isdigit() for v in values):
        raise argparse.ArgumentTypeError(f"expected CPU numbers such as 0,1, got {text!r}")
    return tuple(int(v) for v in values)


def _spare(
    allowed: set[int],
    threads: list[set[int]],
    online: set[int],
    cgroup: set[int],
    nodes: list[set[int]],
) -> tuple[int, ...]:
    """``spare_cpus`` on given sets (empty ``online``/``cgroup``/``nodes``: unknown, no limit)."""
    candidates = set(allowed)
    for limit in (online, cgroup):
        if limit:
            candidates &= limit
    bound: set[int] = set().union(*(t for t in threads if not t >= candidates))
    if not bound:
        return ()
    spare = candidates - bound
    if nodes:
        spare &= set().union(*(n for n in nodes if n & bound))
    return tuple(sorted(spare))


def _cgroup_cpus() -> set[int]:
    """The CPUs of this process's cgroup (v2 ``cpuset.cpus.effective``); empty if unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    for line in lines:
        if line.startswith("0::"):
            path = line[3:].strip("/")
            return _cpu_list_file(os.path.join("/sys/fs/cgroup", path, "cpuset.cpus.effective"))
    return set()


def _cpu_list_file(path: str) -> set[int]:
    """A kernel CPU list file ("0-3,8"); empty when missing or unreadable."""
    cpus: set[int] = set()
    try:
        with open(path) as f:
            text = f.read().strip()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except (OSError, ValueError):
        return set()
    return cpus
