"""Fixtures for the Mooncake tests: a master of the test's own (which it may kill and restart)
and worker processes that are always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.pool.conftest import Worker, spawn_workers
from tests.pools import MooncakeMaster, mooncake_master

Workers = Callable[..., Worker]


@pytest.fixture
def own_master() -> Iterator[MooncakeMaster]:
    """A ``mooncake_master`` for this test alone, stopped when it ends."""
    mooncake_master()  # skips (or fails, in CI) when Mooncake is not installed
    master = MooncakeMaster()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def workers(tmp_path: Any) -> Iterator[Workers]:
    """Start ``tests.mooncake.workers`` processes (``workers(tag, name, **args)``); all are
    killed when the test ends."""
    with spawn_workers(str(tmp_path), "tests.mooncake.workers") as start:
        yield start
