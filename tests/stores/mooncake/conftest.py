"""Fixtures for the Mooncake tests: a master of the test's own (which it may kill and restart)
and worker processes that are always stopped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.pools import MooncakeMaster, mooncake_master
from tests.support.processes import Workers, spawn_workers


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
    """Start ``tests.support.mooncake_workers`` processes (``workers(tag, name, **args)``); all are
    killed when the test ends."""
    with spawn_workers(str(tmp_path), "tests.support.mooncake_workers") as start:
        yield start
