"""The copy executor pins its threads to the configured CPUs."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import kvflow
from kvflow.pipeline.executor import PinnedExecutor, call_pinned
from tests.support.caches import make_caches
from tests.support.threads import start_a_thread
from tests.support.wrappers import WrappedStore

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(not CPUS, reason="CPU affinity is a Linux feature")
async def test_copies_run_on_threads_pinned_to_copy_cpus() -> None:
    target = (CPUS[-1],)
    layout = kvflow.KVLayout.from_tensors(make_caches(3), block_size=16)
    store = WrappedStore(kvflow.LocalStore("8MiB"))
    seen: set[tuple[int, ...]] = set()
    store.before_copy = lambda *a: seen.add(tuple(sorted(os.sched_getaffinity(0))))
    cfg = kvflow.EngineConfig(chunk_blocks=1, copy_threads=2, copy_cpus=target)
    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        await engine.save(np.arange(32), [0, 1])
        assert engine._runtime.copier.pinned >= 1
    assert seen == {target}
    assert tuple(sorted(os.sched_getaffinity(0))) == tuple(CPUS), "the caller was re-pinned"
    store.close()


def test_unpinned_executor_leaves_affinity_alone() -> None:
    pool = PinnedExecutor(1, ())
    try:
        got = pool.submit(lambda: sorted(os.sched_getaffinity(0))).result(60)
        assert got == CPUS
        assert pool.pinned == 0 and pool.in_flight == 0
        assert "in_flight=0" in repr(pool)
    finally:
        pool.shutdown(wait=True)


@pytest.mark.skipif(not CPUS, reason="CPU affinity is a Linux feature")
def test_call_pinned_runs_pinned_and_threads_it_starts_inherit_it() -> None:
    target = (CPUS[-1],)

    assert call_pinned(target, start_a_thread) == list(target)
    assert sorted(os.sched_getaffinity(0)) == CPUS, "the caller was re-pinned"
    assert call_pinned((), start_a_thread) == CPUS  # no CPUs: no pinning


def test_call_pinned_raises_what_the_call_raised() -> None:
    def fail() -> None:
        raise kvflow.StoreUnavailableError("no pool")

    with pytest.raises(kvflow.StoreUnavailableError, match="no pool"):
        call_pinned(tuple(CPUS[-1:]), fail)


@pytest.mark.skipif(not CPUS, reason="CPU affinity is a Linux feature")
def test_call_pinned_gives_up_after_its_timeout_and_hands_a_late_result_on() -> None:
    release = threading.Event()
    late: list[str] = []
    handed = threading.Event()

    def slow() -> str:
        assert release.wait(60)
        return "store"

    def take(value: str) -> None:
        late.append(value)
        handed.set()

    with pytest.raises(kvflow.TransferTimeoutError, match="slow"):
        call_pinned(tuple(CPUS[-1:]), slow, timeout_s=0.2, on_late=take)
    release.set()
    assert handed.wait(60) and late == ["store"]
