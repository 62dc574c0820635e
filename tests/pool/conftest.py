"""Fixtures for the pool tests: short private socket directories, ``kvflow serve`` and
worker subprocesses that are always cleaned up (the helpers are in ``tests.support``)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvflow
from kvflow.pool import PoolServer
from tests.support.disktier import KEYS, disk_pool, save, shared_store
from tests.support.processes import ServeProcess, Worker, spawn_workers


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A fresh private (0700) directory with a short path, for a socket and its siblings."""
    directory = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def serve() -> Iterator[Callable[..., ServeProcess]]:
    """Start ``kvflow serve`` processes (``serve(path, capacity, *args)``, already serving);
    every one is stopped when the test ends."""
    started: list[ServeProcess] = []

    def start(socket_path: str, capacity: int | str = "16MiB", *extra: str) -> ServeProcess:
        server = ServeProcess(socket_path, capacity, *extra)
        started.append(server)
        return server.wait_serving()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def workers(sock_dir: str) -> Iterator[Callable[..., Worker]]:
    """Start worker processes (``workers(tag, name, **args)``); all are killed at the end."""
    with spawn_workers(sock_dir) as start:
        yield start


# -- the disk tier's tests -----------------------------------------------------------------------


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
def pool(sock_dir: str, disk_dir: Path) -> Iterator[PoolServer]:
    """A pool of eight objects' DRAM over an 8 MiB disk tier in ``disk_dir``."""
    with disk_pool(f"{sock_dir}/pool.sock", disk_dir) as server:
        yield server


@pytest.fixture
def store(pool: PoolServer) -> Iterator[kvflow.SharedStore]:
    """A client of ``pool`` that saved KEYS (``tests.support.disktier``), four at a time."""
    with shared_store(pool.socket_path) as client:
        save(client, KEYS)
        yield client
