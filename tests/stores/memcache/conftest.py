"""Fixtures for the memcache tests: the in-memory stand-in for memcache's client (no Ascend
hardware here; see ``tests.support.memcache_standin``) and a MemcacheStore over it; the helpers
are in ``tests.support.memcache``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvflow
from tests.support.memcache_standin import MemcacheStandIn
from tests.support.pools import memcache_standin_store


@pytest.fixture
def standin() -> MemcacheStandIn:
    return MemcacheStandIn(16 << 20)


@pytest.fixture
def store(standin: MemcacheStandIn) -> Iterator[kvflow.MemcacheStore]:
    s = memcache_standin_store(0, client=standin)
    yield s
    s.close()
