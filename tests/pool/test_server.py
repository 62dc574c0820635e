"""PoolServer in-process: file permissions, refusals (directory, second server, foreign peers,
too many clients), lease expiry, and release of a client's sessions when it leaves."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvflow
from kvflow.abc import Direction, WriteStatus
from kvflow.errors import PoolRunningError
from kvflow.pool import PoolConfig, PoolServer
from kvflow.pool import protocol as p
from kvflow.pool import server as server_module
from kvflow.pool.client import PoolConnection
from kvflow.pool.memory import clear_pages, make_arena, map_shared, unmap
from tests.support.caches import make_caches
from tests.support.objects import (
    OBJ_BYTES,
    addr,
    alloc_registered,
    content,
    read_objects,
    write_objects,
)
from tests.support.pools import ServedSharedStore, dispose
from tests.support.waits import wait_for_stats, wait_until
from tests.support.wire import greet, read_to_eof, recv_exact

NOBODY = 65534


@pytest.fixture
def server(sock_dir: str) -> Iterator[PoolServer]:
    srv = PoolServer(PoolConfig(socket=f"{sock_dir}/pool.sock", capacity="8MiB"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def i64(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# -- files and permissions --------------------------------------------------------------------


def test_socket_directory_and_arena_are_private(sock_dir: str) -> None:
    directory = f"{sock_dir}/sub"  # the server creates it
    path = f"{directory}/pool.sock"
    with PoolServer(PoolConfig(socket=path, capacity="4MiB")):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        info = os.stat(path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        for suffix in (".lock", ".pid"):
            assert stat.S_IMODE(os.stat(path + suffix).st_mode) == 0o600
        assert sorted(os.listdir(directory)) == ["pool.sock", "pool.sock.lock", "pool.sock.pid"]
        with greet(path) as conn:
            assert conn.code == p.Code.OK
            assert conn.hello.capacity == 4 << 20
            assert len(conn.fds) == 1
            arena = os.fstat(conn.fds[0])
            assert stat.S_IMODE(arena.st_mode) == 0o600
            assert arena.st_size == 4 << 20
            assert stat.S_ISREG(arena.st_mode)
            assert arena.st_nlink == 0  # never a named file
            assert os.readlink(f"/proc/self/fd/{conn.fds[0]}").startswith("/memfd:")
    # stopped: the socket and pid file are gone (the lock file may stay)
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".pid")


def test_the_arena_is_sealed_against_resizing(sock_dir: str) -> None:
    """A client cannot shrink (or grow) the arena under the other clients."""
    path = f"{sock_dir}/pool.sock"
    with PoolServer(PoolConfig(socket=path, capacity="4MiB")), greet(path) as conn:
        fd = conn.fds[0]
        for size in (0, 1 << 20, 8 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        assert os.fstat(fd).st_size == 4 << 20


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_client_refuses_a_pool_another_user_planted(sock_dir: str) -> None:
    """A server in a directory of another uid (someone squatting the path) is never used: the
    store starts out down, and says so, rather than write KV into another user's memory."""
    path = f"{sock_dir}/pool.sock"
    with PoolServer(PoolConfig(socket=path, capacity="4MiB")):
        os.chown(sock_dir, NOBODY, -1)
        try:
            with pytest.raises(kvflow.StoreUnavailableError, match="belongs to uid"):
                PoolConnection(path, 60.0)
            store = kvflow.SharedStore(socket=path, timeout_s=60)
            with pytest.raises(kvflow.StoreUnavailableError):
                store.lookup(["a"])
            store.close()
            trusting = kvflow.SharedStore(socket=path, timeout_s=60, server_uids=(NOBODY,))
            assert not trusting.lookup(["a"]).any()
            trusting.close()
        finally:
            os.chown(sock_dir, os.getuid(), -1)


def test_directory_writable_by_others_is_refused(sock_dir: str) -> None:
    for mode in (0o777, 0o722, 0o1777, 0o720):
        os.chmod(sock_dir, mode)
        server = PoolServer(PoolConfig(socket=f"{sock_dir}/pool.sock", capacity="1MiB"))
        with pytest.raises(kvflow.ConfigError, match="writable by others"):
            server.start()
        server.stop()
        assert os.listdir(sock_dir) == []
    os.chmod(sock_dir, 0o700)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_directory_of_another_uid_is_refused(sock_dir: str) -> None:
    os.chown(sock_dir, NOBODY, -1)
    server = PoolServer(PoolConfig(socket=f"{sock_dir}/pool.sock", capacity="1MiB"))
    with pytest.raises(kvflow.ConfigError, match="belongs to uid"):
        server.start()
    server.stop()
    assert os.listdir(sock_dir) == []


def test_a_symlinked_directory_is_refused(sock_dir: str) -> None:
    real = f"{sock_dir}/real"
    os.mkdir(real, 0o700)
    os.symlink(real, f"{sock_dir}/link")
    server = PoolServer(PoolConfig(socket=f"{sock_dir}/link/pool.sock", capacity="1MiB"))
    with pytest.raises(kvflow.ConfigError):
        server.start()
    server.stop()


def test_a_capacity_beyond_the_machine_creates_nothing(sock_dir: str) -> None:
    directory = f"{sock_dir}/pool"
    server = PoolServer(PoolConfig(socket=f"{directory}/pool.sock", capacity="1TB"))
    with pytest.raises(kvflow.ConfigError, match="MemAvailable"):
        server.start()
    server.stop()
    assert not os.path.exists(directory)  # no directory, lock, socket or pid file


def test_a_second_server_on_the_same_path_is_refused(server: PoolServer) -> None:
    second = PoolServer(PoolConfig(socket=server.socket_path, capacity="1MiB"))
    with pytest.raises(PoolRunningError):
        second.start()
    second.stop()  # must not touch the first server's files
    with (
        pytest.raises(PoolRunningError),
        PoolServer(PoolConfig(socket=server.socket_path, capacity="1MiB")),
    ):
        pass
    assert os.path.exists(server.socket_path)
    store = kvflow.SharedStore(socket=server.socket_path)
    try:
        assert store.server_stats()["capacity"] == 8 << 20  # the first one answers
        assert store.server_stats()["clients"] == 1
    finally:
        store.close()


def test_a_stopped_servers_path_can_be_served_again(sock_dir: str) -> None:
    path = f"{sock_dir}/pool.sock"
    with PoolServer(PoolConfig(socket=path, capacity="1MiB")):
        pass
    with PoolServer(PoolConfig(socket=path, capacity="2MiB")), greet(path) as conn:
        assert conn.hello.capacity == 2 << 20


# -- the arena's pages ------------------------------------------------------------------------


def resident(addr: int) -> int:
    """Bytes of this process's mapping at ``addr`` that are in its page tables (smaps' Rss)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line[:1] in "0123456789abcdef" and int(line.split("-", 1)[0], 16) == addr:
            rss = next(row for row in lines[i + 1 :] if row.startswith("Rss:"))
            return int(rss.split()[1]) << 10
    raise AssertionError(f"no mapping at {addr:#x}")


def test_clear_pages_faults_the_arena_in_piece_by_piece_and_stops_when_told() -> None:
    size, piece = 8 << 20, 2 << 20
    fd = make_arena(size)
    addr = map_shared(fd, size, populate=False)
    try:
        ctypes.memmove(addr + piece + 5, b"kept", 4)  # a client wrote there first
        assert resident(addr) == 4096
        calls = itertools.count()
        clear_pages(addr, size, lambda: next(calls) == 2, piece)  # two pieces, then stop
        assert resident(addr) == 2 * piece
        clear_pages(addr, size, lambda: False, piece)
        assert resident(addr) == size
        assert ctypes.string_at(addr + piece + 5, 4) == b"kept"  # cleared, not overwritten
        assert ctypes.string_at(addr, 5) == bytes(5)
    finally:
        unmap(addr, size)
        os.close(fd)


def clearing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvflow-pool-clear"]


def test_the_server_serves_while_its_arena_is_cleared(
    sock_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clearing a large arena's pages takes seconds on a loaded machine, while every client's
    call would fail as a miss: clients are served from the start, and what they write before
    the pages are cleared is kept. The clearing here waits for the test's word."""
    go, done = threading.Event(), threading.Event()

    def held(addr: int, size: int, stop: Callable[[], bool]) -> None:
        assert go.wait(60)
        clear_pages(addr, size, stop)
        done.set()

    monkeypatch.setattr(server_module, "clear_pages", held)
    path = f"{sock_dir}/pool.sock"
    with PoolServer(PoolConfig(socket=path, capacity="8MiB")):
        store = kvflow.SharedStore(socket=path, timeout_s=60)
        try:
            objects = {f"c{i}": content(f"c{i}") for i in range(8)}
            assert (write_objects(store, objects) == WriteStatus.GRANTED).all()
            assert not done.is_set() and clearing_threads()
            go.set()
            assert done.wait(60)
            got = read_objects(store, list(objects), OBJ_BYTES)
            for key, want in objects.items():
                np.testing.assert_array_equal(got[key], want)
        finally:
            store.close()
    assert not clearing_threads()


# -- peers ------------------------------------------------------------------------------------

PEER = r"""
import os, socket, struct, sys
path, frame = sys.argv[1], bytes.fromhex(sys.argv[2])
os.setgid(65534)
os.setuid(65534)
assert os.getuid() == 65534
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(60)
try:
    s.connect(path)
except OSError as exc:
    print("connect-failed", exc)
    sys.exit(0)
try:
    s.sendall(frame)
    data, fds, _, _ = socket.recv_fds(s, 64, 4)
except (ConnectionResetError, BrokenPipeError):
    data, fds = b"", []
for fd in fds:
    os.close(fd)
print("accepted" if data and fds else "closed", len(data), len(fds))
"""


def run_as_nobody(path: str) -> str:
    frame = p.frame(p.Op.HELLO, 1, p.hello_body(0)).hex()
    out = subprocess.run(
        [sys.executable, "-I", "-c", PEER, path, frame],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer of another uid")
@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed"])
def test_peers_of_another_uid(allowed: bool) -> None:
    directory = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    try:
        os.chmod(directory, 0o711)  # others may traverse, not list or write
        config = PoolConfig(
            socket=f"{directory}/pool.sock",
            capacity="1MiB",
            socket_mode=0o666,
            allow_uids=(NOBODY,) if allowed else (),
        )
        with PoolServer(config) as srv:
            assert stat.S_IMODE(os.stat(config.socket).st_mode) == 0o666
            out = run_as_nobody(config.socket)
            stats = srv.stats()
            if allowed:
                assert out.startswith("accepted"), out
                assert stats["refused_peers"] == 0
                assert stats["clients_total"] >= 1
            else:
                assert out.startswith("closed"), out
                assert stats["refused_peers"] >= 1
            # our own uid is always accepted
            with greet(config.socket) as conn:
                assert conn.code == p.Code.OK
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_max_clients(sock_dir: str) -> None:
    path = f"{sock_dir}/pool.sock"
    with PoolServer(PoolConfig(socket=path, capacity="1MiB", max_clients=2)) as srv:
        first = PoolConnection(path, 60.0)
        second = PoolConnection(path, 60.0)
        try:
            with pytest.raises(kvflow.PoolRefusedError, match="limit of 2 connections"):
                PoolConnection(path, 60.0)
            assert srv.stats()["refused_limit"] == 1
            assert srv.stats()["refused_peers"] == 0  # that counts uids refused
            assert srv.stats()["clients"] == 2
            first.goodbye()
            first.unmap()
            wait_until(lambda: srv.stats()["clients"] == 1, 60, "the first client to leave")
            third = PoolConnection(path, 60.0)  # room again
            assert third.request(p.Op.STATS)[0] == p.Code.OK
            third.goodbye()
            third.unmap()
        finally:
            for conn in (first, second):
                conn.goodbye()
                conn.unmap()


# -- protocol violations --------------------------------------------------------------------

VIOLATIONS = {
    "request-before-hello": p.frame(p.Op.LOOKUP, 1, p.encode_keys(["a"])),
    "hello-twice": p.frame(p.Op.HELLO, 2, p.hello_body(1)),
    "unknown-op": p.frame(99, 2),
    "trailing-bytes": p.frame(p.Op.STATS, 2, b"x"),
    "other-version": p.HEADER.pack(0, p.VERSION + 1, p.Op.STATS, 0, 2),
    "oversized": p.HEADER.pack(p.MAX_BODY + 1, p.VERSION, p.Op.LOOKUP, 0, 2),
    "body-cut-short": p.HEADER.pack(100, p.VERSION, p.Op.LOOKUP, 0, 2) + b"\x01\x00",
    "header-cut-short": p.frame(p.Op.STATS, 2)[:5],
}
COUNTED_BAD = {"request-before-hello", "hello-twice", "unknown-op", "trailing-bytes", "oversized"}
EXPECTED_CODE = {
    "request-before-hello": p.Code.BAD_REQUEST,
    "hello-twice": p.Code.BAD_REQUEST,
    "unknown-op": p.Code.BAD_REQUEST,
    "trailing-bytes": p.Code.BAD_REQUEST,
    "other-version": p.Code.VERSION_MISMATCH,
}


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_a_protocol_violation_closes_only_that_connection(case: str) -> None:
    store = ServedSharedStore(16 * OBJ_BYTES)
    try:
        write_objects(store, {"kept": content("kept")})
        pending = store.open_write(["pending"], OBJ_BYTES)
        before = store.server_stats()
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.settimeout(60)
            raw.connect(store.socket_path)
            if case != "request-before-hello":
                raw.sendall(p.frame(p.Op.HELLO, 1, p.hello_body(os.getpid())))
                header, fds, _, _ = socket.recv_fds(raw, p.HEADER.size, 4)
                for fd in fds:
                    os.close(fd)
                assert len(header) == p.HEADER.size and len(fds) == 1
                recv_exact(raw, p.HEADER.unpack(header)[0])  # the HELLO reply's body
            raw.sendall(VIOLATIONS[case])
            if case.endswith("cut-short"):
                raw.shutdown(socket.SHUT_WR)
            reply = read_to_eof(raw)  # the server closes it (the timeout fails the test)
        finally:
            raw.close()
        if case in EXPECTED_CODE:
            length, version, code, _, _ = p.HEADER.unpack(reply[: p.HEADER.size])
            assert (version, code) == (p.VERSION, EXPECTED_CODE[case])
            assert len(reply) == p.HEADER.size + length
            assert reply[p.HEADER.size :].decode()  # a reason
        else:
            assert reply == b""
        wait_until(lambda: store.server.stats()["clients"] == 1, 60, "the raw client to go")
        after = store.server_stats()
        for name in ("used", "objects", "pending_writes", "leases", "open_sessions"):
            assert after[name] == before[name], name
        if case in COUNTED_BAD:  # (a peer that leaves mid-message is just gone)
            assert after["bad_messages"] == before["bad_messages"] + 1
        # the other client's session is untouched and completes
        src = alloc_registered(store, OBJ_BYTES)
        src[:] = content("pending")
        failed = store.batch_copy(
            i64(pending.addrs), i64([addr(src)]), i64([OBJ_BYTES]), Direction.TO_POOL
        )
        assert failed.size == 0
        store.finish_write(pending, np.ones(1, dtype=bool))
        got = read_objects(store, ["kept", "pending"], OBJ_BYTES)
        np.testing.assert_array_equal(got["kept"], content("kept"))
        np.testing.assert_array_equal(got["pending"], content("pending"))
    finally:
        dispose(store)


# -- leases and sessions ----------------------------------------------------------------------

# what a lease lasts in the tests that watch one expire: far above a stall of a loaded machine
# between taking it and the checks that it still holds (the tests wait this long, in parallel
# with the rest of the quick tier)
LEASE_TTL_S = 10.0


def test_read_leases_expire() -> None:
    store = ServedSharedStore(4 * OBJ_BYTES, lease_ttl_s=LEASE_TTL_S)
    try:
        write_objects(store, {"old": content("old")})
        session = store.open_read(["old"])
        assert session.found.all()
        assert store.server_stats()["leases"] == 1
        dst = alloc_registered(store, OBJ_BYTES)
        failed = store.batch_copy(
            i64(session.addrs[:1]), i64([addr(dst)]), i64([OBJ_BYTES]), Direction.FROM_POOL
        )
        assert failed.size == 0  # the lease holds for now
        wait_until(lambda: store.server_stats()["expired_leases"] == 1, 60, "the lease to expire")
        stats = store.server_stats()
        assert (stats["leases"], stats["open_sessions"], stats["objects"]) == (0, 0, 1)
        # copies under the lost lease fail, every range of them
        half = OBJ_BYTES // 2
        failed = store.batch_copy(
            i64([session.addrs[0], session.addrs[0] + half]),
            i64([addr(dst), addr(dst) + half]),
            i64([half, half]),
            Direction.FROM_POOL,
        )
        assert sorted(failed.tolist()) == [0, 1]
        with pytest.raises(kvflow.StoreError) as info:
            store.close_read(session)
        assert not isinstance(info.value, kvflow.StoreUnavailableError)
        # the object is evictable again: four new objects fill the pool and push it out
        status = write_objects(store, {f"new-{i}": content(f"new-{i}") for i in range(4)})
        assert (status == WriteStatus.GRANTED).all()
        assert not store.lookup(["old"]).any()
        stats = store.server_stats()
        assert stats["evictions"] == 1 and stats["objects"] == 4
        # the connection is still fine
        got = read_objects(store, ["new-0"], OBJ_BYTES)["new-0"]
        np.testing.assert_array_equal(got, content("new-0"))
    finally:
        dispose(store)


def test_pending_writes_do_not_expire() -> None:
    store = ServedSharedStore(4 * OBJ_BYTES, lease_ttl_s=0.3)
    try:
        write_objects(store, {"other": content("other")})
        reading = store.open_read(["other"])
        writing = store.open_write(["slow"], OBJ_BYTES)
        assert writing.granted.all()
        # the reaper has run past the lease limit: the read lease went, the write did not
        wait_until(lambda: store.server_stats()["expired_leases"] == 1, 60, "the lease to expire")
        stats = store.server_stats()
        assert (stats["pending_writes"], stats["open_sessions"]) == (1, 1)
        src = alloc_registered(store, OBJ_BYTES)
        src[:] = content("slow")
        failed = store.batch_copy(
            i64(writing.addrs), i64([addr(src)]), i64([OBJ_BYTES]), Direction.TO_POOL
        )
        assert failed.size == 0
        store.finish_write(writing, np.ones(1, dtype=bool))
        assert store.lookup(["slow"]).all()
        np.testing.assert_array_equal(
            read_objects(store, ["slow"], OBJ_BYTES)["slow"], content("slow")
        )
        with pytest.raises(kvflow.StoreError):
            store.close_read(reading)
        assert store.server_stats()["open_sessions"] == 0
    finally:
        dispose(store)


async def test_a_load_whose_leases_expire_fails_its_chunks() -> None:
    """A lease lost mid-load never passes bytes off as loaded: the chunks come back FAILED."""
    caches = make_caches(num_layers=4, num_blocks=32, seed=5)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=16)
    store = ServedSharedStore(4 << 20, lease_ttl_s=LEASE_TTL_S)
    config = kvflow.EngineConfig(chunk_blocks=2, prefetch_layers=1, op_timeout_s=60)
    try:
        async with kvflow.TransferEngine(layout, store, config) as engine:
            tokens = np.arange(64) + 7
            assert (await asyncio.wait_for(engine.save(tokens, np.arange(4)), 60)).ok
            async with await engine.start_load([(tokens, np.arange(4, 8))]) as handle:
                await handle.wait_layer(0, timeout=60)  # layer 2 waits for us to pass layer 1
                await asyncio.to_thread(
                    wait_until,
                    lambda: store.server_stats()["expired_leases"] == 1,
                    60,
                    "the load's lease to expire",
                )
                result = await handle.wait(timeout=60)
            assert result.count(kvflow.ChunkStatus.FAILED) == 2, result
            assert not result.ok
            # the pool is fine, and a fresh load works
            stats = store.server_stats()
            assert (stats["leases"], stats["open_sessions"], stats["objects"]) == (0, 0, 2)
            loaded = await asyncio.wait_for(engine.load(tokens, np.arange(8, 12)), 60)
            assert loaded.ok
            for layer in caches:
                raw = layer.numpy().view(np.uint8)
                np.testing.assert_array_equal(raw[0:4], raw[8:12])
    finally:
        dispose(store)


def test_populate_maps_a_usable_arena(server: PoolServer) -> None:
    store = kvflow.SharedStore(socket=server.socket_path, populate=True)
    try:
        objects = {f"p{i}": content(f"p{i}") for i in range(8)}
        assert (write_objects(store, objects) == WriteStatus.GRANTED).all()
        got = read_objects(store, list(objects), OBJ_BYTES)
        for key, want in objects.items():
            np.testing.assert_array_equal(got[key], want)
    finally:
        store.close()


def open_some(store: kvflow.SharedStore) -> None:
    """One pending write and one read lease (of two objects) on ``store``'s connection."""
    write_objects(store, {"a": content("a"), "b": content("b")})
    assert store.open_write(["pending"], OBJ_BYTES).granted.all()
    assert store.open_read(["a", "b"]).found.all()
    stats = store.server_stats()
    assert (stats["pending_writes"], stats["leases"], stats["open_sessions"]) == (1, 2, 2)


def check_released(store: ServedSharedStore, used_before: int) -> None:
    stats = wait_for_stats(
        store.server.stats,
        lambda s: s["released_on_disconnect"] == 2,
        60,
        "the sessions to be released",
    )
    assert stats["pending_writes"] == 0
    assert stats["leases"] == 0
    assert stats["open_sessions"] == 0
    assert stats["objects"] == 2
    assert stats["used"] == used_before
    wait_until(lambda: store.server.stats()["clients"] == 0, 60, "the client to be gone")


def test_close_releases_a_clients_sessions() -> None:
    store = ServedSharedStore(16 * OBJ_BYTES)
    try:
        open_some(store)
        store.close()  # says BYE
        check_released(store, 2 * OBJ_BYTES)
        # another client can rewrite the aborted key and evict the formerly leased ones
        other = kvflow.SharedStore(socket=store.socket_path)
        try:
            assert not other.lookup(["pending"]).any()
            assert (write_objects(other, {"pending": content("pending")}) == 0).all()
        finally:
            other.close()
    finally:
        dispose(store)


def test_abrupt_disconnect_releases_a_clients_sessions() -> None:
    store = ServedSharedStore(16 * OBJ_BYTES)
    try:
        open_some(store)
        conn = store._conn
        assert conn is not None
        conn._sock.close()  # no BYE, as if the process died
        check_released(store, 2 * OBJ_BYTES)
    finally:
        dispose(store)


def test_raw_connection_close_without_bye_releases(server: PoolServer) -> None:
    conn = PoolConnection(server.socket_path, 60.0)
    try:
        code, body = conn.request(p.Op.OPEN_WRITE, p.open_write_body(("x", "y"), OBJ_BYTES))
        assert code == p.Code.OK
        assert (p.parse_session(body, 2)[3] == WriteStatus.GRANTED).all()
        assert server.stats()["pending_writes"] == 2
    finally:
        conn.close()
        conn.unmap()
    stats = wait_for_stats(server.stats, lambda s: s["clients"] == 0, 60, "the client to be gone")
    assert (stats["pending_writes"], stats["used"], stats["released_on_disconnect"]) == (0, 0, 1)


def test_lookup_of_4096_keys(server: PoolServer) -> None:
    store = kvflow.SharedStore(socket=server.socket_path)
    try:
        keys = [f"many/{i:05d}" for i in range(4096)]
        stored = np.random.default_rng(7).random(4096) < 0.3
        size = 64
        stored_keys = [k for k, s in zip(keys, stored, strict=True) if s]
        write_objects(store, {k: content(k, size) for k in stored_keys})
        assert store.server_stats()["objects"] == len(stored_keys)
        found = store.lookup(keys)
        assert found.dtype == bool and found.shape == (4096,)
        np.testing.assert_array_equal(found, stored)
        np.testing.assert_array_equal(store.lookup(keys[::-1]), stored[::-1])
    finally:
        store.close()


def test_sessions_belong_to_their_connection(server: PoolServer) -> None:
    """A connection cannot finish or close another connection's sessions."""
    one = PoolConnection(server.socket_path, 60.0)
    two = PoolConnection(server.socket_path, 60.0)
    try:
        code, body = one.request(p.Op.OPEN_WRITE, p.open_write_body(("mine",), OBJ_BYTES))
        handle = p.parse_session(body, 1)[0]
        code, _ = two.request(p.Op.FINISH_WRITE, p.finish_write_body(handle, np.ones(1, bool)))
        assert code == p.Code.UNKNOWN_SESSION
        code, _ = two.request(p.Op.CLOSE_READ, p.handle_body(handle))
        assert code == p.Code.UNKNOWN_SESSION
        code, _ = one.request(p.Op.CLOSE_READ, p.handle_body(handle))  # a write, not a read
        assert code == p.Code.UNKNOWN_SESSION
        assert server.stats()["pending_writes"] == 1
        code, _ = one.request(p.Op.FINISH_WRITE, p.finish_write_body(handle, np.ones(1, bool)))
        assert code == p.Code.OK
        code, _ = one.request(p.Op.FINISH_WRITE, p.finish_write_body(handle, np.ones(1, bool)))
        assert code == p.Code.UNKNOWN_SESSION
        assert server.stats()["objects"] == 1
    finally:
        for conn in (one, two):
            conn.goodbye()
            conn.unmap()


# -- a connection lost and replaced ------------------------------------------------------------


def test_a_reply_is_read_against_the_connection_it_came_on() -> None:
    """The server is replaced right after open_write has picked its connection: either the call
    fails, or the session works end to end against the arena of the connection that carried
    it; the new pool must not be left with an orphaned pending write."""
    store = ServedSharedStore(1 << 20)
    try:
        real_connected = store._link.connected
        replaced: list[bool] = []

        def connected_then_restart() -> PoolConnection:
            conn = real_connected()
            if not replaced:
                store.server.stop()
                store.server = PoolServer(PoolConfig(socket=store.socket_path, capacity=1 << 20))
                store.server.start()
                replaced.append(True)
            return conn

        store._link.connected = connected_then_restart  # type: ignore[method-assign]
        try:
            session = store.open_write(["k"], OBJ_BYTES)
        except kvflow.StoreUnavailableError:
            session = None
        store._link.connected = real_connected  # type: ignore[method-assign]
        if session is None:  # the next call reconnects and works
            session = store.open_write(["k"], OBJ_BYTES)
        assert replaced
        if session is not None:
            assert session.granted.all()
            conn = store._conn
            assert conn is not None
            assert conn.base <= int(session.addrs[0]) < conn.base + conn.capacity, (
                f"address {int(session.addrs[0]):#x} outside the arena at {conn.base:#x}"
            )
            src = alloc_registered(store, OBJ_BYTES)
            src[:] = content("k")
            failed = store.batch_copy(
                i64(session.addrs), i64([addr(src)]), i64([OBJ_BYTES]), Direction.TO_POOL
            )
            assert failed.size == 0
            store.finish_write(session, np.ones(1, dtype=bool))
            np.testing.assert_array_equal(read_objects(store, ["k"], OBJ_BYTES)["k"], content("k"))
        assert store.server.stats()["pending_writes"] == 0
    finally:
        dispose(store)


def test_copies_for_a_lost_connection_fail_after_a_reconnect(sock_dir: str) -> None:
    """A batch still holding addresses of a lost connection copies after the store has
    reconnected to a restarted server of the same size. The old arena's range stays reserved
    while such sessions live, so the new arena lands elsewhere and the stale copies fail:
    they never reach another session's object, which stays exact."""
    path = f"{sock_dir}/pool.sock"
    capacity = 1 << 20
    first = PoolServer(PoolConfig(socket=path, capacity=capacity))
    first.start()
    second = None
    store = kvflow.SharedStore(socket=path, retry_interval_s=0.05, timeout_s=60)
    try:
        write_objects(store, {"a": content("a")})
        reading = store.open_read(["a"])
        writing = store.open_write(["b"], OBJ_BYTES)
        assert store._conn is not None
        old_base = store._conn.base
        first.stop()
        with pytest.raises(kvflow.StoreUnavailableError):
            store.lookup(["a"])  # drops the connection; nothing to reconnect to yet
        second = PoolServer(PoolConfig(socket=path, capacity=capacity))
        second.start()

        def answers() -> bool:
            try:
                return not store.lookup(["a"]).any()
            except kvflow.StoreUnavailableError:
                return False

        wait_until(answers, 60, "the store to reconnect")
        assert store._conn is not None and store._conn.base != old_base
        fresh = store.open_write(["b"], OBJ_BYTES)  # the slot the old "b" had, most likely
        assert fresh.granted.all()
        src = alloc_registered(store, OBJ_BYTES)
        src[:] = content("b")
        assert (
            store.batch_copy(
                i64(fresh.addrs), i64([addr(src)]), i64([OBJ_BYTES]), Direction.TO_POOL
            ).size
            == 0
        )
        stale = alloc_registered(store, OBJ_BYTES, fill=0xEE)
        for session, direction in ((reading, Direction.FROM_POOL), (writing, Direction.TO_POOL)):
            failed = store.batch_copy(
                i64(session.addrs[:1]), i64([addr(stale)]), i64([OBJ_BYTES]), direction
            )
            assert failed.tolist() == [0]
        store.finish_write(fresh, np.ones(1, dtype=bool))
        np.testing.assert_array_equal(read_objects(store, ["b"], OBJ_BYTES)["b"], content("b"))
        assert (stale == 0xEE).all()
        with pytest.raises(kvflow.StoreUnavailableError):
            store.finish_write(writing, np.ones(1, dtype=bool))
        with pytest.raises(kvflow.StoreUnavailableError):
            store.close_read(reading)
        assert store._link.past == []  # no session refers to the old range: it is freed
    finally:
        store.close()
        if second is not None:
            second.stop()
        first.stop()
