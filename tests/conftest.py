"""Shared fixtures: synthetic KV caches on CPU and stores to run them against; and the tiers.

Two tiers. The quick one, the default run, leaves out tests marked ``slow``: those that start
real vLLM (marked ``vllm`` too) or run for minutes; ``pytest -m slow`` runs them, ``pytest -m
""`` runs both. A test gets its tier's markers from the fixtures it uses (``MARKS_BY_FIXTURE``),
so a test that starts vLLM cannot forget its own; and, unless it names its own, its tier's
per-test timeout (pyproject's ``timeout``, 300 s, for the quick tier; ``SLOW_TIMEOUT_S`` for
the slow one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

import kvflow
from kvflow.abc import Store
from tests.support.caches import make_caches
from tests.support.pools import (
    STORE_NAMES,
    close_stores,
    dispose,
    make_store,
    stop_master,
    stop_servers,
)

MARKS_BY_FIXTURE = {"vllm_python": ("vllm", "slow")}
SLOW_TIMEOUT_S = 900  # one slow test: a few vLLM instances on a loaded 2-core machine
QUICK_WORKERS, SLOW_WORKERS = 4, 2


@pytest.hookimpl(optionalhook=True)  # xdist's: a run without it (benchmarks/gpu_check.sh)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's default): the tier's number of xdist workers. The quick tier
    mostly waits on other processes and threads, so more workers than cores pay; each slow
    test keeps cores busy with a vLLM instance."""
    quick_only = "not slow" in (config.getoption("markexpr") or "")
    return QUICK_WORKERS if quick_only else SLOW_WORKERS


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's tier markers from its fixtures, before ``-m`` selects by them."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        for fixture, marks in MARKS_BY_FIXTURE.items():
            if fixture in fixtures:
                for mark in marks:
                    item.add_marker(mark)
        if item.get_closest_marker("slow") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


# property tests check results, not speed: no per-example deadline (a stall of a loaded machine
# would fail one)
settings.register_profile("kvflow", deadline=None)
settings.load_profile("kvflow")


@pytest.fixture(autouse=True, scope="session")
def _stop_mooncake_master() -> Iterator[None]:
    """The Mooncake master some tests start stops with the test session."""
    yield
    stop_master()


@pytest.fixture(autouse=True)
def _stop_pool_servers() -> Iterator[None]:
    """Stores a test made and pool servers it started are closed and stopped when it ends,
    whatever happened."""
    yield
    close_stores()
    stop_servers()


@pytest.fixture
def bound_to_one_cpu() -> Iterator[int]:
    """The calling thread bound to one CPU (returned) for the test, as vLLM's CPU worker binds
    its model thread; skipped with fewer than two CPUs."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs")
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture(params=STORE_NAMES)
def store_name(request: pytest.FixtureRequest) -> str:
    """Each store engine in turn (``tests.support.pools.STORE_FACTORIES``)."""
    name: str = request.param
    return name


@pytest.fixture
def pool(store_name: str) -> Iterator[Store]:
    """A 64 MiB store of each engine in turn, disposed of after the test."""
    store = make_store(store_name, "64MiB")
    yield store
    dispose(store)


@pytest.fixture
def caches() -> list[torch.Tensor]:
    return make_caches()


@pytest.fixture
def layout(caches: list[torch.Tensor]) -> kvflow.KVLayout:
    return kvflow.KVLayout.from_tensors(caches, block_size=16)


@pytest.fixture
def local_store() -> Iterator[kvflow.LocalStore]:
    store = kvflow.LocalStore("64MiB")
    yield store
    store.close()
