"""Fixtures for the Mooncake tests: a master of the test's own (which it may kill and restart)
and worker processes that are always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.pool.conftest import Worker
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
    started: list[Worker] = []

    def start(tag: str, name: str, /, **args: Any) -> Worker:
        worker = Worker(str(tmp_path), tag, name, module="tests.mooncake.workers", **args)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.stop()
