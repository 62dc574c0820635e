"""Where kvflow's threads run: CPU placement, in one place.

An inference server binds its compute threads to cores (vLLM's CPU worker binds each OpenMP
thread to one). kvflow's copy threads, its pool server and its helper threads then belong on
the CPUs beside them, never on a compute core:

* ``spare_cpus()``: the CPUs of the server's own set that no thread of this process is bound to
  (online, in this process's cgroup, on the NUMA nodes of the bound ones): for copy threads;
* ``server_cpus()``: for a process this one starts to serve others (an auto-started pool);
* ``available_cpus()``: those a thread may be pinned to at all (a config's check);
* ``pin_current_thread(cpus)``, ``pin_all_threads(cpus)``: the pinning itself;
* ``affinity()``: this process's CPUs, for reports; ``cpu_list("0,1")``: a command line's.

Everything here reads ``/proc`` and ``/sys`` or calls ``sched_*affinity``, and answers "no
constraint" (empty) off Linux or where a file cannot be read: placement is an optimisation,
never a requirement. Thread-safe; nothing is cached (affinities change while a process runs).
"""

from __future__ import annotations

import argparse
import glob
import os

__all__ = [
    "affinity",
    "available_cpus",
    "cpu_list",
    "pin_all_threads",
    "pin_current_thread",
    "server_cpus",
    "spare_cpus",
]


def affinity() -> list[int]:
    """This process's CPUs, sorted; empty off Linux."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def available_cpus() -> set[int]:
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


def pin_current_thread(cpus: tuple[int, ...]) -> bool:
    """Pin the calling thread to ``cpus``; False when there are none or the OS refuses.
    Threads it starts afterwards inherit the pinning."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread on Linux
    except OSError:  # pinning is an optimisation, not a requirement
        return False
    return True


def pin_all_threads(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process to ``cpus`` (those started at import, a BLAS's, too;
    later ones inherit it). Raises OSError when the OS refuses (a command reports it)."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


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
