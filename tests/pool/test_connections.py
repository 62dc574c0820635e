"""Connections cannot lock clients out: the connection limit's refusal says why, idle
connections are closed, and a SharedStore whose idle connection was closed never sees a failed
call for it (it reconnects, keeping its mapping of the same arena)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import numpy as np
import pytest

import kvflow
from kvflow.pool import PoolConfig, PoolServer
from kvflow.pool import protocol as p
from kvflow.pool.client import PoolConnection
from tests.support.objects import OBJ_BYTES, content, read_objects, write_objects
from tests.support.waits import wait_until
from tests.support.wire import greet, read_to_eof

IDLE_S = 1.5  # short, for the tests that wait for silent connections to be closed
LONG_IDLE_S = 600.0  # where a test needs connections kept: no stall of the machine reaches it


@pytest.fixture
def idle_server(sock_dir: str) -> Iterator[PoolServer]:
    """A server with a connection limit of 2 and a short idle timeout."""
    config = PoolConfig(
        socket=f"{sock_dir}/pool.sock", capacity="1MiB", max_clients=2, idle_timeout_s=IDLE_S
    )
    with PoolServer(config) as server:
        yield server


def raw_connection(path: str) -> socket.socket:
    """A connection that says nothing at all."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(path)
    return sock


def test_silent_connections_lock_nobody_out(idle_server: PoolServer, sock_dir: str) -> None:
    """At the limit a new client is refused, told why; silent connections are closed once idle,
    and then a client gets in. The refusal is checked on a server whose idle timeout no stall
    of the machine reaches (on ``idle_server`` a stall longer than ``IDLE_S`` between the
    admissions and the third connection would let it in)."""
    config = PoolConfig(
        socket=f"{sock_dir}/full.sock", capacity="1MiB", max_clients=2, idle_timeout_s=LONG_IDLE_S
    )
    with PoolServer(config) as full:
        silent = [raw_connection(full.socket_path) for _ in range(2)]
        try:
            wait_until(lambda: full.stats()["clients"] == 2, 60, "both to be admitted")
            with pytest.raises(kvflow.PoolRefusedError) as caught:
                PoolConnection(full.socket_path, 60.0)
            err = caught.value
            assert isinstance(err, kvflow.StoreUnavailableError)  # the store counts as down
            assert full.socket_path in str(err) and "limit of 2 connections" in err.reason
            assert "--max-clients" in err.reason and f"{LONG_IDLE_S:g} s" in err.reason
            assert full.stats()["refused_limit"] == 1
        finally:
            for sock in silent:
                sock.close()

    path = idle_server.socket_path
    silent = [raw_connection(path) for _ in range(2)]
    try:
        for sock in silent:  # the server closes them once idle: they read EOF
            assert read_to_eof(sock) == b""
        stats = idle_server.stats()
        assert stats["idle_closed"] == 2 and stats["clients"] == 0
    finally:
        for sock in silent:
            sock.close()
    store = kvflow.SharedStore(socket=path)
    try:
        write_objects(store, {"k": content("k")})
        np.testing.assert_array_equal(read_objects(store, ["k"], OBJ_BYTES)["k"], content("k"))
    finally:
        store.close()


def test_connections_holding_sessions_are_never_idle(idle_server: PoolServer) -> None:
    """A client holding a pending write and a read lease stays connected, however long it is
    silent, while connections idle for less time than it are closed."""
    path = idle_server.socket_path
    store = kvflow.SharedStore(socket=path)
    try:
        write_objects(store, {"a": content("a")})
        reading = store.open_read(["a"])
        writing = store.open_write(["b"], OBJ_BYTES)
        with greet(path) as later:  # silent from a later point on than the store
            assert later.code == p.Code.OK
            assert read_to_eof(later.sock) == b""
        assert idle_server.stats()["idle_closed"] == 1
        assert idle_server.stats()["clients"] == 1  # the store's
        store.finish_write(writing, np.zeros(1, dtype=bool))  # no failure: it was kept
        store.close_read(reading)
        assert idle_server.stats()["open_sessions"] == 0
    finally:
        store.close()


def test_an_idle_closed_store_reconnects_without_failing(
    idle_server: PoolServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = kvflow.SharedStore(socket=idle_server.socket_path, timeout_s=60)
    try:
        write_objects(store, {"k": content("k")})
        assert store._conn is not None
        base = store._conn.base
        epoch = store.contents_epoch()
        wait_until(lambda: idle_server.stats()["idle_closed"] == 1, 60, "the idle close")
        with caplog.at_level(logging.INFO, logger="kvflow"):
            assert store.lookup(["k"]).tolist() == [True]
        assert store.reconnects == 2
        assert store._conn.base == base  # the same arena: its mapping was kept, not remade
        assert store.contents_epoch() == epoch  # the same server: nothing was lost
        np.testing.assert_array_equal(read_objects(store, ["k"], OBJ_BYTES)["k"], content("k"))
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        store.close()


def test_a_request_crossing_the_idle_close_is_sent_again(
    idle_server: PoolServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server may close the idle connection just as a request goes out, after the client
    checked it: the request fails on that connection and goes again on a new one."""
    store = kvflow.SharedStore(socket=idle_server.socket_path, timeout_s=60)
    try:
        write_objects(store, {"k": content("k")})
        conn = store._conn
        assert conn is not None
        monkeypatch.setattr(conn, "peer_gone", lambda: False)  # the check misses the close
        wait_until(lambda: idle_server.stats()["idle_closed"] == 1, 60, "the idle close")
        assert store.lookup(["k", "x"]).tolist() == [True, False]
        assert conn.hung_up and store._conn is not conn
        usage = store.usage()
        assert usage.objects == 1 and usage.open_sessions == 0
    finally:
        store.close()


def test_a_request_about_a_session_is_never_sent_again(
    sock_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session ends with its connection: FINISH_WRITE for it fails, and never reaches a new
    connection (whose server would not know the session)."""
    path = f"{sock_dir}/pool.sock"
    first = PoolServer(PoolConfig(socket=path, capacity="1MiB"))
    first.start()
    store = kvflow.SharedStore(socket=path, timeout_s=60, retry_interval_s=0.01)
    second = None
    try:
        writing = store.open_write(["b"], OBJ_BYTES)
        assert store._conn is not None
        monkeypatch.setattr(store._conn, "peer_gone", lambda: False)
        first.stop()
        second = PoolServer(PoolConfig(socket=path, capacity="1MiB"))
        second.start()
        with pytest.raises(kvflow.StoreUnavailableError):
            store.finish_write(writing, np.ones(1, dtype=bool))
        assert second.stats()["requests"] == 0
        assert store.lookup(["b"]).tolist() == [False]  # the next call reconnects
    finally:
        store.close()
        if second is not None:
            second.stop()
        first.stop()


def test_a_new_server_gets_a_new_mapping(sock_dir: str) -> None:
    """Idle or not, a store whose server was replaced maps the new arena (of another size)."""
    path = f"{sock_dir}/pool.sock"
    first = PoolServer(PoolConfig(socket=path, capacity="1MiB"))
    first.start()
    store = kvflow.SharedStore(socket=path, timeout_s=60, retry_interval_s=0.01)
    second = None
    try:
        write_objects(store, {"old": content("old")})
        first.stop()
        second = PoolServer(PoolConfig(socket=path, capacity="2MiB"))
        second.start()
        assert store.lookup(["old"]).tolist() == [False]
        assert store._conn is not None and store._conn.capacity == 2 << 20
        write_objects(store, {"new": content("new")})
        np.testing.assert_array_equal(
            read_objects(store, ["new"], OBJ_BYTES)["new"], content("new")
        )
    finally:
        store.close()
        if second is not None:
            second.stop()
        first.stop()
