"""The pool's wire protocol: every encoder/decoder pair round-trips, ``decode_request`` refuses
every malformed body with ProtocolError (and nothing else), and a live server survives arbitrary
frames: it answers or closes that one connection, never hangs, and changes no state."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvflow
from kvflow.errors import ProtocolError
from kvflow.pool import protocol as p
from kvflow.pool.protocol import MAX_BODY, MAX_KEY_BYTES, MAX_KEYS, Op
from kvflow.pool.service import Connection, Reply
from tests.support.objects import OBJ_BYTES, content, read_objects, write_objects
from tests.support.pools import ServedSharedStore, dispose
from tests.support.waits import wait_until
from tests.support.wire import greet, read_to_eof

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")

keys_st = st.lists(st.text(st.characters(codec="utf-8"), max_size=256), max_size=12)
handle_st = st.integers(0, 2**64 - 1)
nbytes_st = st.integers(1, 2**62 - 1)
flags_st = st.lists(st.booleans(), max_size=40).map(lambda v: np.array(v, dtype=bool))


def reencode(req: p.Request) -> bytes:
    """The canonical body of a decoded request (decoding is exact: this is the input body)."""
    if req.op == Op.HELLO:
        return p.hello_body(req.pid)
    if req.op in (Op.LOOKUP, Op.OPEN_READ, Op.DISK_DROP):
        return p.encode_keys(req.keys)
    if req.op in (Op.LOOKUP_CTX, Op.OPEN_READ_CTX):
        return p.keys_context_body(req.keys, req.context)
    if req.op == Op.OPEN_WRITE:
        return p.open_write_body(req.keys, req.nbytes)
    if req.op == Op.OPEN_WRITE_CTX:
        return p.open_write_context_body(req.keys, req.nbytes, req.context)
    if req.op == Op.FINISH_WRITE:
        assert req.flags is not None
        return p.finish_write_body(req.handle, req.flags)
    if req.op == Op.CLOSE_READ:
        return p.handle_body(req.handle)
    return b""


# -- round trips ------------------------------------------------------------------------------


@given(st.integers(0, 2**32 - 1))
def test_hello_request_round_trip(pid: int) -> None:
    req = p.decode_request(Op.HELLO, p.hello_body(pid))
    assert (req.op, req.pid) == (Op.HELLO, pid)


@pytest.mark.parametrize("op", [Op.LOOKUP, Op.OPEN_READ])
@given(keys=keys_st)
def test_keys_round_trip(op: Op, keys: list[str]) -> None:
    req = p.decode_request(op, p.encode_keys(keys))
    assert req.op == op
    assert req.keys == tuple(keys)


@given(keys=keys_st, nbytes=nbytes_st)
def test_open_write_round_trip(keys: list[str], nbytes: int) -> None:
    req = p.decode_request(Op.OPEN_WRITE, p.open_write_body(tuple(keys), nbytes))
    assert (req.op, req.keys, req.nbytes) == (Op.OPEN_WRITE, tuple(keys), nbytes)


@pytest.mark.parametrize("op", [Op.LOOKUP_CTX, Op.OPEN_READ_CTX])
@given(keys=keys_st, context=keys_st)
def test_keys_and_context_round_trip(op: Op, keys: list[str], context: list[str]) -> None:
    req = p.decode_request(op, p.keys_context_body(tuple(keys), tuple(context)))
    assert (req.op, req.keys, req.context) == (op, tuple(keys), tuple(context))


@given(keys=keys_st, nbytes=nbytes_st, context=keys_st)
def test_open_write_with_context_round_trip(
    keys: list[str], nbytes: int, context: list[str]
) -> None:
    body = p.open_write_context_body(tuple(keys), nbytes, tuple(context))
    req = p.decode_request(Op.OPEN_WRITE_CTX, body)
    assert (req.op, req.keys, req.nbytes, req.context) == (
        Op.OPEN_WRITE_CTX,
        tuple(keys),
        nbytes,
        tuple(context),
    )


@given(handle=handle_st, ok=flags_st)
def test_finish_write_round_trip(handle: int, ok: np.ndarray) -> None:
    req = p.decode_request(Op.FINISH_WRITE, p.finish_write_body(handle, ok))
    assert (req.op, req.handle) == (Op.FINISH_WRITE, handle)
    assert req.flags is not None and req.flags.dtype == bool
    np.testing.assert_array_equal(req.flags, ok)


@given(handle=handle_st)
def test_close_read_round_trip(handle: int) -> None:
    req = p.decode_request(Op.CLOSE_READ, p.handle_body(handle))
    assert (req.op, req.handle) == (Op.CLOSE_READ, handle)


@pytest.mark.parametrize("op", [Op.STATS, Op.BYE])
def test_empty_requests_decode(op: Op) -> None:
    assert p.decode_request(op, b"") == p.Request(op)
    assert p.decode_request(int(op), b"").op == op


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1))
def test_hello_reply_round_trip(capacity: int, instance: int, ttl_ms: int) -> None:
    hello = p.Hello(capacity, instance, ttl_ms)
    assert p.parse_hello(p.hello_reply(hello)) == hello


@given(st.lists(st.integers(0, 1), max_size=64))
def test_flags_reply_round_trip(found: list[int]) -> None:
    arr = np.array(found, dtype=np.uint8)
    out = p.parse_flags(p.flags_reply(arr), len(found))
    np.testing.assert_array_equal(out, arr)


@given(
    handle=handle_st,
    rows=st.lists(
        st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**63 - 1), st.integers(0, 3)),
        max_size=40,
    ),
)
def test_session_reply_round_trip(handle: int, rows: list[tuple[int, int, int]]) -> None:
    offsets = np.array([r[0] for r in rows], dtype=np.int64)
    sizes = np.array([r[1] for r in rows], dtype=np.int64)
    flags = np.array([r[2] for r in rows], dtype=np.uint8)
    got = p.parse_session(p.session_reply(handle, offsets, sizes, flags), len(rows))
    assert got[0] == handle
    for out, want in zip(got[1:], (offsets, sizes, flags), strict=True):
        np.testing.assert_array_equal(out, want)
    assert got[1].dtype == np.int64 and got[2].dtype == np.int64


@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=len(p.STATS_FIELDS), max_size=len(p.STATS_FIELDS))
)
def test_stats_reply_round_trip(values: list[int]) -> None:
    stats = dict(zip(p.STATS_FIELDS, values, strict=True))
    assert p.parse_stats(p.stats_reply(stats)) == stats


@given(st.integers(0, 255), st.integers(0, 2**32 - 1), st.binary(max_size=64))
def test_frame_round_trip(op: int, rid: int, body: bytes) -> None:
    data = p.frame(op, rid, body)
    assert p.HEADER.unpack(data[: p.HEADER.size]) == (len(body), p.VERSION, op, 0, rid)
    assert data[p.HEADER.size :] == body


def test_keys_at_the_limits_are_accepted() -> None:
    longest = "k" * MAX_KEY_BYTES
    assert p.decode_request(Op.LOOKUP, p.encode_keys([longest, ""])).keys == (longest, "")
    many = U32.pack(MAX_KEYS) + bytes(2 * MAX_KEYS)  # MAX_KEYS empty keys
    assert len(p.decode_request(Op.LOOKUP, many).keys) == MAX_KEYS
    flags = U64.pack(7) + U32.pack(MAX_KEYS) + bytes(MAX_KEYS)
    req = p.decode_request(Op.FINISH_WRITE, flags)
    assert req.flags is not None and req.flags.shape == (MAX_KEYS,) and not req.flags.any()
    req = p.decode_request(Op.OPEN_WRITE, p.open_write_body(("a",), 2**62 - 1))
    assert req.nbytes == 2**62 - 1


# -- refusals ---------------------------------------------------------------------------------

VALID = {
    Op.HELLO: p.hello_body(1234),
    Op.LOOKUP: p.encode_keys(["alpha", "βeta", ""]),
    Op.OPEN_WRITE: p.open_write_body(("alpha", "gamma"), 8192),
    Op.FINISH_WRITE: p.finish_write_body(9, np.array([True, False, True])),
    Op.OPEN_READ: p.encode_keys(["alpha"]),
    Op.CLOSE_READ: p.handle_body(9),
    Op.STATS: b"",
    Op.BYE: b"",
    Op.LOOKUP_CTX: p.keys_context_body(("alpha",), ("a0", "βeta")),
    Op.OPEN_WRITE_CTX: p.open_write_context_body(("gamma",), 8192, ("alpha",)),
    Op.OPEN_READ_CTX: p.keys_context_body(("alpha", "gamma"), ()),
}


def refused(op: int, body: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        p.decode_request(op, body)
    return str(info.value)


def test_valid_bodies_decode() -> None:
    for op, body in VALID.items():
        assert p.decode_request(op, body).op == op


@pytest.mark.parametrize("op", [op for op, body in VALID.items() if body], ids=lambda o: o.name)
def test_truncated_bodies_are_refused(op: Op) -> None:
    body = VALID[op]
    for cut in range(len(body)):
        refused(op, body[:cut])


@pytest.mark.parametrize("op", list(VALID), ids=lambda o: o.name)
@pytest.mark.parametrize("extra", [b"\x00", b"\x01\x02\x03", bytes(64)])
def test_trailing_bytes_are_refused(op: Op, extra: bytes) -> None:
    assert "trailing" in refused(op, VALID[op] + extra)


@pytest.mark.parametrize("op", [0, 14, 15, 127, 255])
def test_unknown_ops_are_refused(op: int) -> None:
    assert "unknown op" in refused(op, b"")
    refused(op, VALID[Op.LOOKUP])


@pytest.mark.parametrize("op", [Op.LOOKUP, Op.OPEN_READ])
def test_key_counts_over_the_limit_are_refused(op: Op) -> None:
    for n in (MAX_KEYS + 1, 2**32 - 1):
        assert "limit" in refused(op, U32.pack(n))
    # even with every byte the count asks for present
    body = U32.pack(MAX_KEYS + 1) + bytes(2 * (MAX_KEYS + 1))
    assert "limit" in refused(op, body)
    assert "limit" in refused(Op.OPEN_WRITE, U64.pack(4096) + body)


@pytest.mark.parametrize("length", [MAX_KEY_BYTES + 1, 4096, 0xFFFF])
def test_keys_over_the_length_limit_are_refused(length: int) -> None:
    body = U32.pack(1) + struct.pack("<H", length) + b"k" * length
    assert "limit" in refused(Op.LOOKUP, body)
    assert "limit" in refused(Op.OPEN_READ, body)
    assert "limit" in refused(Op.OPEN_WRITE, U64.pack(4096) + body)
    body2 = U32.pack(2) + struct.pack("<HH", 1, length) + b"a" + b"k" * length
    assert "limit" in refused(Op.LOOKUP, body2)


@pytest.mark.parametrize(
    "raw",
    [b"\xff", b"\xc3", b"\xc0\x80", b"\xed\xa0\x80", b"ok\xfe", b"\xf4\x90\x80\x80"],
    ids=["ff", "truncated", "overlong", "surrogate", "trailing-fe", "above-max"],
)
def test_non_utf8_keys_are_refused(raw: bytes) -> None:
    body = U32.pack(2) + struct.pack("<HH", 2, len(raw)) + b"ok" + raw
    assert "UTF-8" in refused(Op.LOOKUP, body)
    assert "UTF-8" in refused(Op.OPEN_READ, body)
    assert "UTF-8" in refused(Op.OPEN_WRITE, U64.pack(4096) + body)


@pytest.mark.parametrize("bad", [2, 3, 128, 255])
def test_ok_flags_other_than_0_or_1_are_refused(bad: int) -> None:
    body = U64.pack(1) + U32.pack(3) + bytes([1, bad, 0])
    assert "0 or 1" in refused(Op.FINISH_WRITE, body)


def test_flag_counts_over_the_limit_are_refused() -> None:
    assert "limit" in refused(Op.FINISH_WRITE, U64.pack(1) + U32.pack(MAX_KEYS + 1))
    refused(Op.FINISH_WRITE, U64.pack(1) + U32.pack(5) + bytes(4))  # fewer flags than counted


@pytest.mark.parametrize("nbytes", [0, 2**62, 2**62 + 1, 2**63, 2**64 - 1])
def test_object_sizes_out_of_range_are_refused(nbytes: int) -> None:
    body = U64.pack(nbytes) + p.encode_keys(["a"])
    assert "out of range" in refused(Op.OPEN_WRITE, body)


def test_encoders_refuse_what_the_decoder_would() -> None:
    """The caller's bad keys: a typed error naming the argument, before anything is sent."""
    for keys in (
        ["k" * (MAX_KEY_BYTES + 1)],
        ["é" * (MAX_KEY_BYTES // 2 + 1)],  # 2 bytes a character
        [""] * (MAX_KEYS + 1),
        ["\ud800"],  # a lone surrogate cannot be UTF-8
    ):
        with pytest.raises(kvflow.InvalidArgumentError) as info:
            p.encode_keys(keys)
        assert info.value.argument == "keys"


def test_reply_parsers_refuse_malformed_replies() -> None:
    flags = p.flags_reply(np.ones(3, dtype=np.uint8))
    with pytest.raises(ProtocolError):
        p.parse_flags(flags, 4)
    for bad in (flags[:-1], flags + b"\x00"):
        with pytest.raises(ProtocolError):
            p.parse_flags(bad, 3)
    session = p.session_reply(1, np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2))
    with pytest.raises(ProtocolError):
        p.parse_session(session, 3)
    for bad in (session[:-1], session + b"\x00"):
        with pytest.raises(ProtocolError):
            p.parse_session(bad, 2)
    hello = p.hello_reply(p.Hello(1, 2, 3))
    for bad in (hello[:-1], hello + b"\x00"):
        with pytest.raises(ProtocolError):
            p.parse_hello(bad)
    stats = p.stats_reply(dict.fromkeys(p.STATS_FIELDS, 1))
    for bad in (stats[:-1], stats + b"\x00", U32.pack(5000) + bytes(8 * 5000)):
        with pytest.raises(ProtocolError):
            p.parse_stats(bad)


# -- fuzzing the decoder ----------------------------------------------------------------------


def decode_or_refuse(op: int, body: bytes) -> p.Request | None:
    """The decoder's whole contract: a Request for ``op`` that re-encodes to exactly ``body``,
    or ProtocolError. Any other exception fails the test."""
    try:
        req = p.decode_request(op, body)
    except ProtocolError:
        return None
    assert isinstance(req, p.Request)
    assert req.op == op
    assert reencode(req) == body
    return req


@settings(max_examples=300, deadline=None)
@given(op=st.integers(0, 255), body=st.binary(max_size=300))
def test_fuzz_random_bodies(op: int, body: bytes) -> None:
    decode_or_refuse(op, body)


@st.composite
def valid_request(draw: st.DrawFn) -> tuple[int, bytes, list[tuple[int, int]]]:
    """A valid (op, body) and where its length fields are: (offset, width) pairs."""
    op = draw(st.sampled_from(list(Op)))
    if op == Op.HELLO:
        return op, p.hello_body(draw(st.integers(0, 2**32 - 1))), []
    if op in (Op.LOOKUP, Op.OPEN_READ, Op.OPEN_WRITE):
        keys = draw(st.lists(st.text(st.characters(codec="utf-8"), max_size=20), max_size=6))
        start = 0
        if op == Op.OPEN_WRITE:
            body = p.open_write_body(tuple(keys), draw(nbytes_st))
            start = 8
        else:
            body = p.encode_keys(keys)
        fields = [(start, 4)] + [(start + 4 + 2 * i, 2) for i in range(len(keys))]
        return op, body, fields
    if op in (Op.LOOKUP_CTX, Op.OPEN_READ_CTX, Op.OPEN_WRITE_CTX):
        text = st.text(st.characters(codec="utf-8"), max_size=20)
        keys = draw(st.lists(text, max_size=4))
        context = draw(st.lists(text, max_size=4))
        start = 8 if op == Op.OPEN_WRITE_CTX else 0
        first = p.open_write_body(tuple(keys), draw(nbytes_st)) if start else p.encode_keys(keys)
        body = first + p.encode_keys(context)
        fields = [(start, 4), (len(first), 4)]
        fields += [(start + 4 + 2 * i, 2) for i in range(len(keys))]
        fields += [(len(first) + 4 + 2 * i, 2) for i in range(len(context))]
        return op, body, fields
    if op == Op.FINISH_WRITE:
        return op, p.finish_write_body(draw(handle_st), draw(flags_st)), [(8, 4)]
    if op == Op.CLOSE_READ:
        return op, p.handle_body(draw(handle_st)), []
    return op, b"", []


@st.composite
def mutated_request(draw: st.DrawFn) -> tuple[int, bytes]:
    op, body, fields = draw(valid_request())
    kinds = ["truncate", "flip", "append"] + (["inflate"] if fields else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "truncate":
        assume(body)
        return op, body[: draw(st.integers(0, len(body) - 1))]
    if kind == "append":
        return op, body + draw(st.binary(min_size=1, max_size=16))
    if kind == "flip":
        assume(body)
        raw = bytearray(body)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(raw) - 1))
            raw[at] ^= 1 << draw(st.integers(0, 7))
        return op, bytes(raw)
    at, width = draw(st.sampled_from(fields))
    old = int.from_bytes(body[at : at + width], "little")
    new = draw(st.integers(old + 1, 2 ** (8 * width) - 1))
    return op, body[:at] + new.to_bytes(width, "little") + body[at + width :]


@settings(max_examples=300, deadline=None)
@given(mutated_request())
def test_fuzz_mutated_valid_bodies(case: tuple[int, bytes]) -> None:
    op, body = case
    decode_or_refuse(op, body)


@settings(max_examples=100, deadline=None)
@given(valid_request(), st.integers(0, 255))
def test_fuzz_valid_bodies_under_another_op(case: tuple[int, bytes, object], op: int) -> None:
    decode_or_refuse(op, case[1])


# -- fuzzing a live server --------------------------------------------------------------------

COMPARED = ("capacity", "used", "objects", "pending_writes", "leases", "open_sessions")


@st.composite
def raw_frames(draw: st.DrawFn) -> tuple[bytes, int]:
    """Bytes to send after HELLO: one frame with arbitrary header fields and body (random, or a
    mutated valid body), possibly cut short, possibly followed by garbage; and its request id."""
    if draw(st.booleans()):
        op, body = draw(mutated_request())
    else:
        op, body = draw(st.integers(0, 255)), draw(st.binary(max_size=200))
    version = draw(st.one_of(st.just(p.VERSION), st.integers(0, 255)))
    op = draw(st.one_of(st.just(op), st.integers(0, 255)))
    length = draw(
        st.one_of(
            st.just(len(body)),
            st.integers(0, len(body) + 32),
            st.sampled_from([MAX_BODY, MAX_BODY + 1, 2**32 - 1]),
            st.integers(0, 2**32 - 1),
        )
    )
    rid = draw(st.integers(0, 2**32 - 1))
    pad = draw(st.integers(0, 0xFFFF))
    data = p.HEADER.pack(length, version, op, pad, rid) + body
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    data += draw(st.binary(max_size=40))
    return data, rid


def check_reply_frames(data: bytes) -> None:
    """Whatever the server sent back is well-formed frames with known codes."""
    at = 0
    while at < len(data):
        assert len(data) - at >= p.HEADER.size, f"a torn reply header: {data[at:]!r}"
        length, version, code, _, _ = p.HEADER.unpack_from(data, at)
        assert version == p.VERSION
        p.Code(code)
        at += p.HEADER.size + length
        assert at <= len(data), "a torn reply body"


def test_fuzz_live_server_survives_arbitrary_frames() -> None:
    store = ServedSharedStore(16 << 20)
    try:
        objects = {f"fuzz-{i}": content(f"fuzz-{i}") for i in range(6)}
        write_objects(store, objects)
        before = store.server_stats()
        path = store.socket_path

        @settings(
            max_examples=200,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(raw_frames())
        def one(case: tuple[bytes, int]) -> None:
            data, _ = case
            with greet(path) as conn:
                assert conn.code == p.Code.OK and len(conn.fds) == 1
                try:
                    conn.sock.sendall(data)
                    conn.sock.shutdown(socket.SHUT_WR)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server already closed this connection: allowed
                try:
                    replies = read_to_eof(conn.sock)
                except TimeoutError:
                    pytest.fail(f"the server neither answered nor closed after {data[:64]!r}")
                check_reply_frames(replies)
            # that connection is gone and released; the pool is exactly as it was
            wait_until(
                lambda: store.server.stats()["clients"] == 1, 60, "the server to drop the client"
            )
            after = store.server_stats()
            assert {k: after[k] for k in COMPARED} == {k: before[k] for k in COMPARED}, data

        one()
        assert store.lookup(list(objects)).all()
        got = read_objects(store, list(objects), OBJ_BYTES)
        for key, want in objects.items():
            np.testing.assert_array_equal(got[key], want)
        stats = store.server_stats()
        assert stats["bad_messages"] > 0
        assert {k: stats[k] for k in COMPARED} == {k: before[k] for k in COMPARED}
    finally:
        dispose(store)


# -- features: what a server understands beyond the first ops ---------------------------------


def served_ops(store: ServedSharedStore, monkeypatch: pytest.MonkeyPatch) -> list[Op]:
    """Record the op of every request the store's server handles from now on."""
    ops: list[Op] = []
    handle = store.server.service.handle

    def recording(conn: Connection, op: int, body: bytes) -> Reply:
        ops.append(Op(op))
        return handle(conn, op, body)

    monkeypatch.setattr(store.server.service, "handle", recording)
    return ops


def context_calls(store: ServedSharedStore) -> None:
    """A lookup, a save and a load of "b" that name "a" as context."""
    store.lookup_with_context(["b"], ["a"])
    session = store.open_write_with_context(["b"], OBJ_BYTES, ["a"])
    store.finish_write(session, np.ones(1, dtype=bool))
    store.close_read(store.open_read_with_context(["b"], ["a"]))


def test_the_server_names_its_features_in_the_hello_reply() -> None:
    store = ServedSharedStore(1 << 20)
    try:
        with greet(store.socket_path) as conn:
            assert conn.code == p.Code.OK
            assert conn.flags == p.FEATURES and p.FEATURES & p.Feature.CONTEXT
    finally:
        dispose(store)


def test_context_goes_in_the_ctx_ops_and_none_without_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = ServedSharedStore(1 << 20)
    try:
        ops = served_ops(store, monkeypatch)
        context_calls(store)
        store.lookup(["b"])
        with_empty = store.lookup_with_context(["b"], [])
        assert with_empty.tolist() == [True]
        ctx = [Op.LOOKUP_CTX, Op.OPEN_WRITE_CTX, Op.FINISH_WRITE, Op.OPEN_READ_CTX]
        assert ops == [*ctx, Op.CLOSE_READ, Op.LOOKUP, Op.LOOKUP]
    finally:
        dispose(store)


def test_a_server_without_the_context_feature_is_sent_the_plain_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool of an earlier release of protocol 1 names no features: the client leaves the
    context out and the calls still work."""
    monkeypatch.setattr(p, "FEATURES", p.Feature(0))
    store = ServedSharedStore(1 << 20)
    try:
        ops = served_ops(store, monkeypatch)
        context_calls(store)
        assert ops == [Op.LOOKUP, Op.OPEN_WRITE, Op.FINISH_WRITE, Op.OPEN_READ, Op.CLOSE_READ]
        assert store.lookup(["b", "a"]).tolist() == [True, False]
    finally:
        dispose(store)
