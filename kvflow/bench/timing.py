"""Timing, and the machine around it.

Timing is wall clock (``time.perf_counter``) everywhere: the copy scenario runs copies on
several threads, where a thread's CPU time says nothing about throughput. Noise from other work
on the machine is handled by taking the best of N repeats and by timing the things a ratio
compares in turn inside every repeat, so that a slow spell hits both sides. The load average
beside a result says how busy the machine was; ``pin_cpus`` picks the CPUs for copy threads.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvflow.cpus import affinity

__all__ = ["best_times", "compute_pinned", "gc_paused", "load_average", "pin_cpus"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (a collection would be timed)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def best_times(fns: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1) -> list[float]:
    """Best wall-clock seconds of each function over ``repeats`` rounds, the functions timed in
    turn inside every round, after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    with gc_paused():
        for _ in range(max(repeats, 1)):
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def pin_cpus(threads: int) -> tuple[int, ...]:
    """The last ``threads`` CPUs this process may run on: where pinned copy threads go."""
    return tuple(affinity()[-threads:])


@contextmanager
def compute_pinned(cpus: set[int] | None, threads: int) -> Iterator[None]:
    """Pin the calling (compute) thread and set torch's thread count; restore both after."""
    old_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    if cpus and old_cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        if old_cpus is not None:
            os.sched_setaffinity(0, old_cpus)
