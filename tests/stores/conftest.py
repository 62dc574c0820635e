"""Fixtures for the store contract suite: every store in ``tests.support.pools.STORE_FACTORIES``
runs every test (add a pool engine there); the helpers are in ``tests.support.objects``.

A test marked ``@pytest.mark.arena("why")`` runs only on ``ARENA_STORE_NAMES``, the pools with a
fixed-size arena, LRU eviction and ``usage()``; elsewhere it is skipped, saying why.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvflow.abc import Store
from tests.support.objects import SMALL_CAPACITY, STORE_CAPACITY
from tests.support.pools import ARENA_STORE_NAMES, dispose, make_store


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "arena(why): needs a fixed-size arena with LRU eviction and usage() (ARENA_STORE_NAMES)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip ``arena`` tests on the other stores before their fixtures start a pool."""
    for item in items:
        marker = item.get_closest_marker("arena")
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("store_name") if callspec else None
        if marker is not None and name is not None and name not in ARENA_STORE_NAMES:
            why = marker.args[0] if marker.args else "it watches the arena"
            reason = f"{name} has no fixed-size arena with LRU eviction and usage(): {why}"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def store(store_name: str) -> Iterator[Store]:
    """A store of STORE_CAPACITY bytes, closed after the test."""
    s = make_store(store_name, STORE_CAPACITY)
    yield s
    dispose(s)


@pytest.fixture
def small_store(store_name: str) -> Iterator[Store]:
    """A store with room for exactly SMALL_OBJECTS objects of OBJ_BYTES: for eviction tests."""
    s = make_store(store_name, SMALL_CAPACITY)
    yield s
    dispose(s)
