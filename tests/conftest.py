"""Shared fixtures: synthetic KV caches on CPU and stores to run them against."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

import kvflow
from kvflow.abc import Store
from tests.pools import STORE_NAMES, dispose, make_store, stop_master, stop_servers

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
    """Pool servers a test started stop when it ends, whatever happened."""
    yield
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
    """Each store engine in turn (``tests.pools.STORE_FACTORIES``)."""
    name: str = request.param
    return name


@pytest.fixture
def pool(store_name: str) -> Iterator[Store]:
    """A 64 MiB store of each engine in turn, disposed of after the test."""
    store = make_store(store_name, "64MiB")
    yield store
    dispose(store)


def make_caches(
    num_layers: int = 4,
    num_blocks: int = 64,
    block_shape: tuple[int, ...] = (2, 16, 8),
    dtype: torch.dtype = torch.float16,
    *,
    seed: int = 0,
) -> list[torch.Tensor]:
    """One ``[num_blocks, *block_shape]`` tensor per layer, filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(num_layers):
        raw = torch.randint(0, 256, (num_blocks, *block_shape), generator=gen, dtype=torch.uint8)
        nbytes = torch.empty((), dtype=dtype).element_size()
        shape = (num_blocks, *block_shape[:-1], block_shape[-1] // nbytes)
        caches.append(raw.view(dtype).reshape(shape) if nbytes > 1 else raw)
    return caches


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
