"""PoolService without any socket: requests given as op and body, replies decoded as a client
would. Writes, reads and their sessions, each session owned by its connection and released
when that ends, lease expiry on an injected clock, context ops, the counters, and malformed
requests refused without a change."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.abc import WriteStatus
from kvflow.errors import ProtocolError
from kvflow.pool import protocol as p
from kvflow.pool.config import PoolConfig
from kvflow.pool.service import COUNTERS, Connection, PoolService, Reply

OBJ = 8192  # a whole number of 4 KiB slots
TTL_S = 30.0
CAPACITY = 4 * OBJ  # four objects


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def service(clock: Clock) -> PoolService:
    config = PoolConfig(socket="/tmp/kvf-unused/pool.sock", capacity=CAPACITY, lease_ttl_s=TTL_S)
    return PoolService(config, instance=7, clock=clock)


def greeted(service: PoolService, pid: int = 100) -> Connection:
    """A connection that has said HELLO."""
    conn = service.connect(pid, uid=1000)
    reply = service.handle(conn, p.Op.HELLO, p.hello_body(pid))
    assert reply.code == p.Code.OK
    return conn


def ok(reply: Reply) -> bytes:
    assert reply.code == p.Code.OK, reply
    return reply.body


def lookup(service: PoolService, conn: Connection, keys: list[str]) -> list[bool]:
    body = ok(service.handle(conn, p.Op.LOOKUP, p.encode_keys(keys)))
    return p.parse_flags(body, len(keys)).astype(bool).tolist()


def open_write(
    service: PoolService, conn: Connection, keys: list[str]
) -> tuple[int, np.ndarray, np.ndarray]:
    body = ok(service.handle(conn, p.Op.OPEN_WRITE, p.open_write_body(tuple(keys), OBJ)))
    handle, offsets, _, status = p.parse_session(body, len(keys))
    return handle, offsets, status


def finish(service: PoolService, conn: Connection, handle: int, ok_flags: list[bool]) -> Reply:
    flags = np.array(ok_flags, dtype=bool)
    return service.handle(conn, p.Op.FINISH_WRITE, p.finish_write_body(handle, flags))


def write(service: PoolService, conn: Connection, keys: list[str]) -> None:
    handle, _, status = open_write(service, conn, keys)
    assert (status == WriteStatus.GRANTED).all()
    ok(finish(service, conn, handle, [True] * len(keys)))


def open_read(service: PoolService, conn: Connection, keys: list[str]) -> tuple[int, list[bool]]:
    body = ok(service.handle(conn, p.Op.OPEN_READ, p.encode_keys(keys)))
    handle, _, sizes, found = p.parse_session(body, len(keys))
    assert sizes.tolist() == [OBJ if f else 0 for f in found]
    return handle, found.astype(bool).tolist()


def close_read(service: PoolService, conn: Connection, handle: int) -> p.Code:
    return service.handle(conn, p.Op.CLOSE_READ, p.handle_body(handle)).code


# -- the connection's first and last words ----------------------------------------------------


def test_hello_answers_with_the_pool_and_asks_for_the_arena(service: PoolService) -> None:
    conn = service.connect(42, uid=1000)
    reply = service.handle(conn, p.Op.HELLO, p.hello_body(42))
    assert (reply.code, reply.flags, reply.arena, reply.last) == (
        p.Code.OK,
        p.FEATURES,
        True,
        False,
    )
    assert p.parse_hello(reply.body) == p.Hello(CAPACITY, 7, int(TTL_S * 1000))
    assert service.stats()["clients"] == 1 and service.stats()["clients_total"] == 1


def test_bye_releases_the_sessions_before_its_reply(service: PoolService) -> None:
    conn = greeted(service)
    write(service, conn, ["a"])
    open_read(service, conn, ["a"])
    open_write(service, conn, ["b"])
    assert service.stats()["open_sessions"] == 2
    reply = service.handle(conn, p.Op.BYE, b"")
    assert (reply.code, reply.last, reply.arena) == (p.Code.OK, True, False)
    stats = service.stats()
    assert (stats["open_sessions"], stats["leases"], stats["pending_writes"]) == (0, 0, 0)
    assert (stats["clients"], stats["released_on_disconnect"]) == (0, 2)
    service.disconnect(conn)  # the server's own end of it, after BYE: nothing more to do
    assert service.stats()["released_on_disconnect"] == 2


# -- writes and reads ---------------------------------------------------------------------------


def test_a_committed_write_is_found_and_read(service: PoolService) -> None:
    conn = greeted(service)
    handle, offsets, status = open_write(service, conn, ["a", "b"])
    assert status.tolist() == [WriteStatus.GRANTED] * 2
    assert len(set(offsets.tolist())) == 2
    assert lookup(service, conn, ["a", "b"]) == [False, False]  # invisible until committed
    ok(finish(service, conn, handle, [True, False]))  # "b" aborted
    assert lookup(service, conn, ["a", "b"]) == [True, False]
    read, found = open_read(service, conn, ["a", "b"])
    assert found == [True, False]
    assert service.stats()["leases"] == 1
    assert close_read(service, conn, read) == p.Code.OK
    stats = service.stats()
    assert (stats["objects"], stats["leases"], stats["open_sessions"]) == (1, 0, 0)
    assert (stats["requests"], stats["hits"], stats["misses"]) == (6, 1, 3)


def test_an_aborted_write_frees_its_slot(service: PoolService) -> None:
    conn = greeted(service)
    handle, _, _ = open_write(service, conn, ["a"])
    assert service.stats()["used"] == OBJ
    ok(finish(service, conn, handle, [False]))
    stats = service.stats()
    assert (stats["used"], stats["pending_writes"], stats["objects"]) == (0, 0, 0)
    assert lookup(service, conn, ["a"]) == [False]


def test_a_session_ends_once(service: PoolService) -> None:
    conn = greeted(service)
    handle, _, _ = open_write(service, conn, ["a"])
    ok(finish(service, conn, handle, [True]))
    assert finish(service, conn, handle, [True]).code == p.Code.UNKNOWN_SESSION
    read, _ = open_read(service, conn, ["a"])
    assert close_read(service, conn, read) == p.Code.OK
    assert close_read(service, conn, read) == p.Code.UNKNOWN_SESSION


def test_a_session_is_never_ended_the_wrong_way(service: PoolService) -> None:
    conn = greeted(service)
    write(service, conn, ["a"])
    read, _ = open_read(service, conn, ["a"])
    writing, _, _ = open_write(service, conn, ["b"])
    assert finish(service, conn, read, [True]).code == p.Code.UNKNOWN_SESSION
    assert close_read(service, conn, writing) == p.Code.UNKNOWN_SESSION
    assert service.stats()["open_sessions"] == 2


def test_a_full_pool_answers_no_space(service: PoolService) -> None:
    conn = greeted(service)
    handles = [open_write(service, conn, [f"k{i}"])[0] for i in range(4)]
    _, _, status = open_write(service, conn, ["more"])
    assert status.tolist() == [WriteStatus.NO_SPACE]
    assert service.stats()["no_space"] == 1
    for handle in handles:
        ok(finish(service, conn, handle, [True]))


# -- ownership ----------------------------------------------------------------------------------


def test_sessions_belong_to_their_connection(service: PoolService) -> None:
    one, two = greeted(service, 1), greeted(service, 2)
    write(service, one, ["a"])
    writing, _, _ = open_write(service, one, ["b"])
    reading, _ = open_read(service, one, ["a"])
    assert finish(service, two, writing, [True]).code == p.Code.UNKNOWN_SESSION
    assert close_read(service, two, reading) == p.Code.UNKNOWN_SESSION
    assert lookup(service, two, ["b"]) == [False]  # still pending: the other's end did nothing
    ok(finish(service, one, writing, [True]))
    assert close_read(service, one, reading) == p.Code.OK
    assert lookup(service, two, ["a", "b"]) == [True, True]


def test_a_connections_close_releases_its_sessions_only(service: PoolService) -> None:
    one, two = greeted(service, 1), greeted(service, 2)
    write(service, one, ["a", "b"])
    open_write(service, one, ["gone"])
    open_read(service, one, ["a"])
    kept, _ = open_read(service, two, ["b"])
    assert service.stats()["open_sessions"] == 3
    service.disconnect(one)
    stats = service.stats()
    assert (stats["open_sessions"], stats["leases"], stats["pending_writes"]) == (1, 1, 0)
    assert (stats["clients"], stats["released_on_disconnect"]) == (1, 2)
    assert lookup(service, two, ["a", "gone"]) == [True, False]  # the write was aborted
    assert close_read(service, two, kept) == p.Code.OK


def test_a_closed_connections_leased_objects_are_evictable_again(service: PoolService) -> None:
    one, two = greeted(service, 1), greeted(service, 2)
    write(service, one, ["old"])
    open_read(service, one, ["old"])
    pending, _, _ = open_write(service, two, ["k0", "k1", "k2"])  # the pool is full
    _, _, status = open_write(service, two, ["new"])
    assert status.tolist() == [WriteStatus.NO_SPACE]  # "old" is leased: nothing to evict
    service.disconnect(one)
    handle, _, status = open_write(service, two, ["new"])
    assert status.tolist() == [WriteStatus.GRANTED]
    assert service.stats()["evictions"] == 1
    ok(finish(service, two, handle, [True]))
    ok(finish(service, two, pending, [True] * 3))
    assert lookup(service, two, ["old", "new", "k0"]) == [False, True, True]


# -- lease expiry ---------------------------------------------------------------------------------


def test_read_leases_expire_on_the_clock(service: PoolService, clock: Clock) -> None:
    conn = greeted(service)
    write(service, conn, ["a"])
    read, _ = open_read(service, conn, ["a"])
    clock.now += TTL_S - 1
    assert service.expire() == 0
    assert service.stats()["leases"] == 1
    clock.now += 1  # exactly the lease limit
    assert service.expire() == 1
    stats = service.stats()
    assert (stats["expired_leases"], stats["leases"], stats["open_sessions"]) == (1, 0, 0)
    assert not service.holds_sessions(conn)
    assert close_read(service, conn, read) == p.Code.EXPIRED  # told once
    assert close_read(service, conn, read) == p.Code.UNKNOWN_SESSION
    assert service.expire() == 0


def test_each_lease_runs_from_its_own_open(service: PoolService, clock: Clock) -> None:
    conn = greeted(service)
    write(service, conn, ["a"])
    first, _ = open_read(service, conn, ["a"])
    clock.now += TTL_S / 2
    second, _ = open_read(service, conn, ["a"])
    clock.now += TTL_S / 2
    assert service.expire() == 1
    assert close_read(service, conn, first) == p.Code.EXPIRED
    assert close_read(service, conn, second) == p.Code.OK


def test_pending_writes_never_expire(service: PoolService, clock: Clock) -> None:
    conn = greeted(service)
    handle, _, _ = open_write(service, conn, ["slow"])
    clock.now += 100 * TTL_S
    assert service.expire() == 0
    assert service.holds_sessions(conn)
    ok(finish(service, conn, handle, [True]))
    assert lookup(service, conn, ["slow"]) == [True]


def test_an_expired_lease_is_not_released_again_at_disconnect(
    service: PoolService, clock: Clock
) -> None:
    conn = greeted(service)
    write(service, conn, ["a"])
    open_read(service, conn, ["a"])
    clock.now += TTL_S
    assert service.expire() == 1
    service.disconnect(conn)
    stats = service.stats()
    assert (stats["released_on_disconnect"], stats["expired_leases"]) == (0, 1)
    assert stats["open_sessions"] == 0


# -- context ---------------------------------------------------------------------------------------


def test_context_ops_answer_for_their_keys_only(service: PoolService) -> None:
    conn = greeted(service)
    write(service, conn, ["a"])
    body = ok(service.handle(conn, p.Op.LOOKUP_CTX, p.keys_context_body(("b", "a"), ("a",))))
    assert p.parse_flags(body, 2).tolist() == [0, 1]
    body = p.open_write_context_body(("b",), OBJ, ("a",))
    handle, _, _, status = p.parse_session(ok(service.handle(conn, p.Op.OPEN_WRITE_CTX, body)), 1)
    assert status.tolist() == [WriteStatus.GRANTED]
    ok(finish(service, conn, handle, [True]))
    body = ok(service.handle(conn, p.Op.OPEN_READ_CTX, p.keys_context_body(("b",), ("a",))))
    read, _, _, found = p.parse_session(body, 1)
    assert found.tolist() == [1]
    assert service.stats()["leases"] == 1  # the context is never leased
    assert close_read(service, conn, read) == p.Code.OK


def test_a_save_spares_its_context(service: PoolService) -> None:
    """The pool is full; a save of "d" naming "a" as its context evicts another object."""
    conn = greeted(service)
    for key in ("a", "x", "y", "z"):
        write(service, conn, [key])
    body = p.open_write_context_body(("d",), OBJ, ("a",))
    handle, _, _, status = p.parse_session(ok(service.handle(conn, p.Op.OPEN_WRITE_CTX, body)), 1)
    assert status.tolist() == [WriteStatus.GRANTED]
    ok(finish(service, conn, handle, [True]))
    assert lookup(service, conn, ["a", "d"]) == [True, True]
    assert lookup(service, conn, ["x"]) == [False]  # the least recently used but "a"


# -- counters and stats ----------------------------------------------------------------------------


def test_stats_has_every_field_in_order(service: PoolService) -> None:
    conn = greeted(service)
    body = ok(service.handle(conn, p.Op.STATS, b""))
    stats = p.parse_stats(body)
    assert list(stats) == list(p.STATS_FIELDS)
    assert stats == service.stats() and stats["requests"] == 1  # the reply counts itself
    assert (stats["capacity"], stats["max_clients"]) == (CAPACITY, service.config.max_clients)
    assert stats["idle_timeout_ms"] == round(service.config.idle_timeout_s * 1000)


def test_the_servers_counts_are_kept(service: PoolService) -> None:
    for name in COUNTERS:
        service.count(name)
    stats = service.stats()
    assert all(stats[name] == 1 for name in COUNTERS)
    with pytest.raises(KeyError):
        service.count("no_such_counter")


# -- malformed requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "body"),
    [
        (99, b""),  # an unknown op
        (p.Op.LOOKUP, p.encode_keys(["a"])[:-1]),  # truncated
        (p.Op.LOOKUP, p.encode_keys(["a"]) + b"\0"),  # trailing bytes
        (p.Op.OPEN_WRITE, p.open_write_body(("a",), OBJ)[:5]),
        (p.Op.OPEN_WRITE, b"\0" * 8 + p.encode_keys(["a"])),  # an object of 0 bytes
        (p.Op.FINISH_WRITE, p.finish_write_body(1, np.array([2], dtype=np.uint8))),
        (p.Op.CLOSE_READ, b"\1\2\3"),
        (p.Op.STATS, b"\0"),
        (p.Op.HELLO, p.hello_body(1)),  # a second HELLO
    ],
    ids=[
        "unknown_op",
        "truncated",
        "trailing",
        "short",
        "zero_size",
        "flag",
        "handle",
        "stats_body",
        "second_hello",
    ],
)
def test_a_malformed_request_is_refused_and_changes_nothing(
    service: PoolService, op: int, body: bytes
) -> None:
    conn = greeted(service)
    write(service, conn, ["a"])
    handle, _, _ = open_write(service, conn, ["b"])
    before = service.stats()
    with pytest.raises(ProtocolError):
        service.handle(conn, op, body)
    assert service.stats() == before
    ok(finish(service, conn, handle, [True]))  # the connection's state is intact
    assert lookup(service, conn, ["a", "b"]) == [True, True]


@pytest.mark.parametrize("op", [p.Op.LOOKUP, p.Op.STATS, p.Op.BYE])
def test_hello_must_come_first(service: PoolService, op: p.Op) -> None:
    conn = service.connect(5, uid=1000)
    body = p.encode_keys(["a"]) if op == p.Op.LOOKUP else b""
    with pytest.raises(ProtocolError, match="HELLO must come first"):
        service.handle(conn, op, body)
    assert service.stats()["requests"] == 0
    assert service.handle(conn, p.Op.HELLO, p.hello_body(5)).code == p.Code.OK


def test_an_object_larger_than_the_pool_gets_no_space(service: PoolService) -> None:
    conn = greeted(service)
    body = ok(service.handle(conn, p.Op.OPEN_WRITE, p.open_write_body(("a",), 1 << 61)))
    _, _, _, status = p.parse_session(body, 1)
    assert status.tolist() == [WriteStatus.NO_SPACE]
    assert service.stats()["pending_writes"] == 0
