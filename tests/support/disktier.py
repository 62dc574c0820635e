"""The pool server's disk tier for its tests: a real ``PoolServer`` on a private socket with a
disk tier in a real folder, objects saved so that what DRAM evicts is on disk already, and
reads layer by layer as the engine makes them (several ranges per object, none aligned to the
tier's 16 KiB checksum ranges, arena and disk objects in one call)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvflow
from kvflow.abc import Direction, ReadSession, Store, WriteStatus
from kvflow.pool import PoolConfig, PoolServer
from kvflow.pool.diskfiles import FORMAT_DIR, PAGE, object_path
from kvflow.pool.diskread import TAG
from kvflow.stores.arena import slot_bytes
from tests.support.objects import addr, alloc_registered, content, write_objects
from tests.support.waits import wait_for_stats

__all__ = [
    "DISK",
    "DRAM",
    "FILE",
    "KEYS",
    "LAYERS",
    "OBJ",
    "SLOT",
    "TAG",
    "disk_pool",
    "files",
    "fill_up",
    "keys_of",
    "mounted",
    "object_file",
    "on_disk",
    "read_layers",
    "save",
    "shared_store",
    "wait_idle",
    "wrong",
]

OBJ = 40_000  # payload bytes: two whole 16 KiB checksum ranges and part of a third
SLOT = slot_bytes(OBJ)  # what one takes in the arena
FILE = PAGE + OBJ  # its file: one page of header, then the payload
# per layer, two ranges of each object (as a K and a V half would be), 5000 bytes each: they
# straddle the 16 KiB checksum ranges' boundaries
LAYERS = [[(layer * 5000, 5000), (20_000 + layer * 5000, 5000)] for layer in range(4)]


def keys_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


KEYS = keys_of("k", 16)  # twice what the test pools' DRAM holds: the first eight end up on disk
DRAM, DISK = KEYS[8:], KEYS[:8]


@contextlib.contextmanager
def disk_pool(
    socket: str, disk_dir: str | Path, objects: int = 8, disk_capacity: int | str = "8MiB",
    **options: Any,
) -> Iterator[PoolServer]:  # fmt: skip
    """A started pool server on ``socket`` whose arena holds ``objects`` objects of OBJ bytes,
    over a disk tier in ``disk_dir``; stopped when the block ends."""
    config = PoolConfig(
        socket=socket,
        capacity=objects * SLOT,
        disk_dir=str(disk_dir),
        disk_capacity=disk_capacity,
        **options,
    )
    with PoolServer(config) as server:
        yield server


@contextlib.contextmanager
def shared_store(socket: str) -> Iterator[kvflow.SharedStore]:
    """A client of the pool on ``socket`` (timeouts far above a stall), closed at the end."""
    store = kvflow.SharedStore(socket=socket, timeout_s=60)
    try:
        yield store
    finally:
        store.close()


def wait_idle(stats: Callable[[], dict[str, int]]) -> dict[str, int]:
    """Wait until the disk tier has copied everything queued, down or up (``disk_queued``: a
    commit or the end of a read session queues its keys before the server answers); the
    stats then."""
    return wait_for_stats(
        stats, lambda s: s["disk_queued"] == 0, 60, "the disk tier's queues to empty"
    )


def save(store: kvflow.SharedStore, keys: Sequence[str], batch: int = 4) -> None:
    """Write and commit ``keys`` (their ``content``), ``batch`` at a time, each batch once the
    disk tier has dealt with the one before (``wait_idle``): DRAM then evicts only what the
    writer is done with (a commit DRAM evicts before the writer's turn is never written)."""
    for at in range(0, len(keys), batch):
        part = list(keys[at : at + batch])
        status = write_objects(store, {key: content(key, OBJ) for key in part})
        assert (status == WriteStatus.GRANTED).all(), dict(zip(part, status, strict=True))
        wait_idle(store.server_stats)


def read_layers(
    store: Store, session: ReadSession, fill: int = 0xA5
) -> tuple[np.ndarray, list[int]]:
    """Copy the found objects of ``session`` layer by layer (``LAYERS``: one ``batch_copy`` per
    layer with every object's ranges) into a buffer filled with ``fill``, one row per key;
    the buffer and the positions of the keys whose ranges failed."""
    n = len(session.keys)
    out = alloc_registered(store, n * OBJ, fill=fill).reshape(n, OBJ)
    found = np.flatnonzero(session.found)
    failed: set[int] = set()
    for layer in LAYERS:
        pool = [int(session.addrs[i]) + off for i in found for off, _ in layer]
        local = [addr(out) + int(i) * OBJ + off for i in found for off, _ in layer]
        sizes = [size for _ in found for _, size in layer]
        bad = store.batch_copy(
            np.array(pool, np.int64), np.array(local, np.int64), np.array(sizes, np.int64),
            Direction.FROM_POOL,
        )  # fmt: skip
        failed.update(int(found[j // len(layer)]) for j in bad)
    return out, sorted(failed)


def on_disk(session: ReadSession) -> list[bool]:
    """Which keys of ``session`` its client reads from their files (tagged addresses)."""
    return [bool(f and a >= TAG) for f, a in zip(session.found, session.addrs, strict=True)]


def object_file(disk_dir: str | Path, key: str) -> Path:
    return Path(object_path(str(Path(disk_dir) / FORMAT_DIR / "objects"), key))


def files(disk_dir: str | Path, suffix: str = ".kvo") -> list[Path]:
    return sorted((Path(disk_dir) / FORMAT_DIR / "objects").glob(f"*/*{suffix}"))


@contextlib.contextmanager
def mounted(path: Path, *how: str) -> Iterator[Path]:
    """``mount *how`` on ``path`` (a tmpfs, a bind mount) for the block, unmounted whatever
    happens. The tests run as root here and in CI; elsewhere they skip."""
    done = subprocess.run(["mount", *how, str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        reason = f"cannot mount {how}: {done.stderr.strip() or done.returncode}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill_up(path: Path) -> None:
    """Take every free byte of ``path``'s filesystem with the file ``path``."""
    with path.open("wb") as f:
        fs = os.statvfs(path.parent)
        os.posix_fallocate(f.fileno(), 0, fs.f_bavail * fs.f_frsize)


def wrong(out: np.ndarray, keys: Sequence[str]) -> list[str]:
    """The keys whose row of ``out`` (``read_layers``) is not their ``content``."""
    return [
        key
        for row, key in zip(out, keys, strict=True)
        if not np.array_equal(row, content(key, OBJ))
    ]
