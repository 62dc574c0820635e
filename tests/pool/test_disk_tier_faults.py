"""The pool server's disk tier when things go wrong: damaged files fail their chunk only and
are dropped, never read as wrong bytes; a server killed mid-write comes back with whole
objects only; a full or read-only disk costs the disk copies only; bad disk options and a
folder in use are refused at start, naming the option."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvflow
from kvflow.abc import WriteStatus
from kvflow.pool import PoolServer
from kvflow.pool.diskfiles import FORMAT_DIR
from kvflow.pool.launch import is_serving
from tests.support.disktier import (
    DISK,
    DRAM,
    KEYS,
    OBJ,
    SLOT,
    disk_pool,
    files,
    fill_up,
    keys_of,
    mounted,
    object_file,
    on_disk,
    read_layers,
    save,
    shared_store,
    wrong,
)
from tests.support.objects import content, write_objects
from tests.support.processes import REPO, ServeProcess
from tests.support.waits import wait_until

FILL = 0xA5  # what the destination holds before a read


def payload_start(path: Path) -> int:
    """Where the payload starts in an object file (its header's length field)."""
    return int.from_bytes(path.read_bytes()[8:12], "little")


def read_all(
    store: kvflow.SharedStore, keys: list[str]
) -> tuple[list[bool], np.ndarray, list[int]]:
    """Open ``keys``, read them layer by layer, close: found, the bytes, the failed positions."""
    session = store.open_read(keys)
    try:
        out, failed = read_layers(store, session, fill=FILL)
    finally:
        store.close_read(session)
    return session.found.tolist(), out, failed


def assert_never_wrong(out: np.ndarray, keys: list[str], bad: int) -> None:
    """Every key but ``bad`` came back exact; each byte of ``bad``'s is right or untouched."""
    others = [i for i in range(len(keys)) if i != bad]
    assert wrong(out[others], [keys[i] for i in others]) == []
    want = content(keys[bad], OBJ)
    assert ((out[bad] == want) | (out[bad] == FILL)).all(), f"{keys[bad]} got wrong bytes"
    assert not np.array_equal(out[bad], want)


# -- damaged files -----------------------------------------------------------------------------


def test_a_flipped_byte_fails_that_chunk_only_and_the_pool_drops_it(
    pool: PoolServer, store: kvflow.SharedStore, disk_dir: Path
) -> None:
    bad = DISK[1]
    path = object_file(disk_dir, bad)
    data = bytearray(path.read_bytes())
    data[payload_start(path) + 30_000] ^= 0x01  # in the second 16 KiB range, every layer's
    path.write_bytes(bytes(data))
    wanted = DISK[:4] + DRAM[:4]
    found, out, failed = read_all(store, wanted)
    assert found == [True] * 8
    assert failed == [1]
    assert_never_wrong(out, wanted, 1)
    s = pool.stats()
    assert (s["disk_dropped_by_clients"], s["disk_objects"]) == (1, 15)
    assert not path.exists()
    assert store.lookup(wanted).tolist() == [True, False] + [True] * 6


@pytest.mark.parametrize(
    ("when", "keep"),
    [("before the open", 100), ("before the open", 30_000), ("while open", 30_000)],
    ids=["header-before-open", "payload-before-open", "payload-while-open"],
)
def test_a_truncated_file_misses_or_fails_and_the_pool_drops_it(
    pool: PoolServer, store: kvflow.SharedStore, disk_dir: Path, when: str, keep: int
) -> None:
    """Cut short before the client opens it, a file is no valid object: a miss. Cut short
    while open, its reads come short: that chunk fails."""
    bad = DISK[1]
    path = object_file(disk_dir, bad)
    cut = keep if keep < OBJ // 10 else payload_start(path) + keep
    wanted = DISK[:4] + DRAM[:4]
    if when == "before the open":
        os.truncate(path, cut)
    session = store.open_read(wanted)
    try:
        if when == "while open":
            os.truncate(path, cut)
        out, failed = read_layers(store, session, fill=FILL)
    finally:
        store.close_read(session)
    if when == "while open":
        assert session.found.all() and failed == [1]
    else:
        assert session.found.tolist() == [True, False] + [True] * 6 and failed == []
    assert_never_wrong(out, wanted, 1)
    # what the client read bad it reports; what it could not open, the promoter finds bad
    wait_until(lambda: not store.lookup([bad])[0], 60, f"the pool to drop {bad}")
    s = pool.stats()
    assert s["disk_dropped_by_clients"] + s["disk_corrupt"] == 1, s
    assert s["disk_objects"] == 15 and not path.exists()


def test_a_pool_killed_while_writing_comes_back_with_whole_objects_only(
    sock_dir: str, disk_dir: Path, serve: Callable[..., ServeProcess]
) -> None:
    path = f"{sock_dir}/pool.sock"
    disk = ("--disk-dir", str(disk_dir), "--disk-capacity", "8MiB")
    server = serve(path, 8 * SLOT, *disk)
    with shared_store(path) as store:
        save(store, KEYS[:4])  # on disk for sure
        for at in range(4, 16, 4):  # the writer runs behind these
            part = KEYS[at : at + 4]
            status = write_objects(store, {key: content(key, OBJ) for key in part})
            assert (status == WriteStatus.GRANTED).all()
        server.kill()
    whole = files(disk_dir)
    torn = disk_dir / FORMAT_DIR / "objects" / "ab" / ("ab" + "0" * 30 + ".tmp")
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"KVFD" + bytes(100))

    serve(path, 8 * SLOT, *disk)
    assert files(disk_dir, ".tmp") == []
    with shared_store(path) as store:
        s = store.server_stats()
        assert s["disk_recovered"] == s["disk_objects"] == len(whole) >= 4
        hit = store.lookup(KEYS)
        assert hit[:4].all() and hit.sum() == len(whole)
        keys = [key for key, h in zip(KEYS, hit, strict=True) if h]
        found, out, failed = read_all(store, keys)
    assert all(found) and failed == []
    assert wrong(out, keys) == []


# -- a disk that takes no more -------------------------------------------------------------------


def test_a_full_disk_costs_the_disk_copies_only(sock_dir: str, tmp_path: Path) -> None:
    """A 2 MiB tmpfs, a 1 MiB tier on it, then every free byte taken by another file."""
    fs = tmp_path / "fs"
    fs.mkdir()
    path = f"{sock_dir}/pool.sock"
    with (
        mounted(fs, "-t", "tmpfs", "-o", "size=2m", "tmpfs"),
        disk_pool(path, fs / "disk", disk_capacity="1MiB") as server,
        shared_store(path) as store,
    ):
        save(store, KEYS[:4])
        fill_up(fs / "filler")
        save(store, KEYS[4:12])  # every save commits
        s = server.stats()
        assert (s["demotions"], s["disk_objects"]) == (4, 4)
        assert (s["disk_io_errors"], s["disk_no_space"]) == (8, 8)
        assert files(fs / "disk", ".tmp") == []
        session = store.open_read(KEYS[:12])  # four from disk, eight from DRAM
        try:
            assert on_disk(session) == [True] * 4 + [False] * 8
            out, failed = read_layers(store, session)
        finally:
            store.close_read(session)
        assert failed == []
        assert wrong(out, KEYS[:12]) == []
        (fs / "filler").unlink()
        save(store, KEYS[12:])  # room again: written again
        assert server.stats()["demotions"] == 8


def test_a_read_only_disk_costs_the_disk_copies_only(
    pool: PoolServer, store: kvflow.SharedStore, disk_dir: Path
) -> None:
    """The objects' folder remounted read-only under the running server (a bind mount: the
    tier's lock file, open for writing, is outside it)."""
    objects = disk_dir / FORMAT_DIR / "objects"
    with mounted(objects, "--bind", str(objects)):
        subprocess.run(["mount", "-o", "remount,bind,ro", str(objects)], check=True)
        more = keys_of("m", 4)
        save(store, more)
        s = pool.stats()
        assert (s["demotions"], s["disk_io_errors"], s["disk_no_space"]) == (16, 4, 0)
        wanted = DISK[:4] + more
        found, out, failed = read_all(store, wanted)  # files still read, DRAM still serves
        assert found == [True] * 8 and failed == []
        assert wrong(out, wanted) == []


# -- refusals at start ---------------------------------------------------------------------------


def kvflow_serve(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvflow", "serve", "--socket", socket, "--capacity", "1MiB"]
    return subprocess.run(
        [*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--disk-dir", "{tmp}/file", "--disk-capacity", "1MiB"), "--disk-dir"),
        (("--disk-dir", "{tmp}/file/under", "--disk-capacity", "1MiB"), "--disk-dir"),
        (("--disk-dir", "{tmp}/disk", "--disk-capacity", "1000TiB"), "--disk-capacity"),
        (("--disk-dir", "{tmp}/disk"), "--disk-capacity"),
        (("--disk-capacity", "1MiB"), "--disk-dir"),
    ],
    ids=["a-file", "under-a-file", "beyond-the-free-space", "no-capacity", "no-folder"],
)
def test_bad_disk_options_are_refused_by_name_serving_nothing(
    sock_dir: str, tmp_path: Path, args: tuple[str, ...], option: str
) -> None:
    (tmp_path / "file").write_bytes(b"x")
    path = f"{sock_dir}/pool.sock"
    run = kvflow_serve(path, *(arg.format(tmp=tmp_path) for arg in args))
    assert run.returncode == 2, run
    assert run.stderr.startswith(f"kvflow serve: {option} "), run.stderr
    assert not is_serving(path) and not Path(path).exists()
    assert os.listdir(sock_dir) == []  # no socket, pid or lock file either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert (tmp_path / "file").read_bytes() == b"x"


def test_a_second_pool_on_the_same_disk_folder_is_refused(
    sock_dir: str, disk_dir: Path, serve: Callable[..., ServeProcess]
) -> None:
    disk = ("--disk-dir", str(disk_dir), "--disk-capacity", "1MiB")
    first = f"{sock_dir}/pool.sock"
    serve(first, "1MiB", *disk)
    second = f"{sock_dir}/other.sock"
    run = kvflow_serve(second, *disk)
    assert run.returncode == 2, run
    assert run.stderr.startswith("kvflow serve: --disk-dir "), run.stderr
    assert "in use" in run.stderr
    assert not Path(second).exists()
    with shared_store(first) as store:
        assert store.server_stats()["disk_capacity"] == 1 << 20  # the first one serves on
