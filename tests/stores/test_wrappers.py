"""Stores that forward to another (``StoreWrapper`` and its subclasses) forward everything, the
optional abilities included: a wrapped arena still hears the prefix context that keeps a prompt's
head reachable, and still reports its usage.

Every wrapper kvflow ships is checked: ``StoreWrapper`` itself, ``kvflow.testing``'s
``InstrumentedStore`` and the vLLM connector's process-wide embedded pool.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import kvflow
from kvflow.abc import Direction, ReadSession, Store, StoreUsage, StoreWrapper, WriteSession
from kvflow.integrations.vllm.pools import _SharedLocal
from kvflow.keys import chunk_hashes
from kvflow.testing import InstrumentedStore
from tests.support.caches import make_caches
from tests.support.objects import OBJ_BYTES, SMALL_CAPACITY, SMALL_OBJECTS
from tests.support.pools import dispose, make_store

WRAPPERS: dict[str, Callable[[Store], StoreWrapper]] = {
    "StoreWrapper": StoreWrapper,
    "InstrumentedStore": InstrumentedStore,
    "vllm_process_wide": _SharedLocal,
}
# what a wrapper deliberately keeps from its inner store
KEPT_BACK = {"vllm_process_wide": {"close"}}  # it lives as long as the process
NEVER_FORWARDED = {"prepare_writes"}  # a wrapper's own batch_copy must run (Store's docstring)


# -- every call reaches the inner store, as it was made ------------------------------------------


class Recorder(Store):
    """Records each call and answers with a value of its own, so that a wrapper that answers
    instead of forwarding (a default of ``Store``, a call to another method) is seen."""

    inline_metadata = True
    device_memory = frozenset({"cpu", "npu"})
    saves_in_memory = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.answers: dict[str, object] = {}

    def _record(self, name: str, *args: Any) -> Any:
        self.calls.append((name, args))
        return self.answers.setdefault(name, object())

    def register(self, regions: Any) -> None:
        self._record("register", regions)

    def unregister(self, regions: Any) -> None:
        self._record("unregister", regions)

    def lookup(self, keys: Any) -> Any:
        return self._record("lookup", keys)

    def lookup_with_context(self, keys: Any, context: Any) -> Any:
        return self._record("lookup_with_context", keys, context)

    def open_write(self, keys: Any, nbytes: int) -> Any:
        return self._record("open_write", keys, nbytes)

    def open_write_with_context(self, keys: Any, nbytes: int, context: Any) -> Any:
        return self._record("open_write_with_context", keys, nbytes, context)

    def finish_write(self, session: Any, ok: Any) -> None:
        self._record("finish_write", session, ok)

    def open_read(self, keys: Any) -> Any:
        return self._record("open_read", keys)

    def open_read_with_context(self, keys: Any, context: Any) -> Any:
        return self._record("open_read_with_context", keys, context)

    def close_read(self, session: Any) -> None:
        self._record("close_read", session)

    def batch_copy(self, pool_addrs: Any, local_addrs: Any, sizes: Any, direction: Any) -> Any:
        return self._record("batch_copy", pool_addrs, local_addrs, sizes, direction)

    def prepare_writes(self, layers: Any) -> Any:
        return self._record("prepare_writes", layers)

    def usage(self) -> Any:
        return self._record("usage")

    def contents_epoch(self) -> Any:
        return self._record("contents_epoch")

    def close(self) -> None:
        self._record("close")


def _arguments(name: str) -> tuple[Any, ...]:
    """Arguments for a call of ``Store`` that a wrapper may inspect (counting keys, sizes)."""
    keys, context = ("k1", "k2"), ("c0",)
    write = WriteSession(1, keys, np.zeros(2, np.int64), np.zeros(2, np.int8))
    read = ReadSession(2, keys, np.zeros(2, np.int64), np.ones(2, bool))
    sizes = np.array([8, 8], np.int64)
    table: dict[str, tuple[Any, ...]] = {
        "register": ([(4096, 64)],),
        "unregister": ([(4096, 64)],),
        "lookup": (keys,),
        "lookup_with_context": (keys, context),
        "open_write": (keys, 8192),
        "open_write_with_context": (keys, 8192, context),
        "finish_write": (write, np.ones(2, bool)),
        "open_read": (keys,),
        "open_read_with_context": (keys, context),
        "close_read": (read,),
        "batch_copy": (sizes, sizes, sizes, Direction.TO_POOL),
        "prepare_writes": ([(sizes, sizes, sizes)],),
        "usage": (),
        "contents_epoch": (),
        "close": (),
    }
    return table[name]


ANSWERED = {
    "lookup",
    "lookup_with_context",
    "open_write",
    "open_write_with_context",
    "open_read",
    "open_read_with_context",
    "batch_copy",
    "usage",
    "contents_epoch",
}


def store_calls() -> list[str]:
    """Every public method of ``Store``: a call added to it is checked here at once."""
    return sorted(
        name
        for name, member in inspect.getmembers(Store, inspect.isfunction)
        if not name.startswith("_")
    )


def test_the_call_list_covers_the_abilities() -> None:
    assert {"lookup_with_context", "open_write_with_context", "open_read_with_context"} <= set(
        store_calls()
    )
    assert "usage" in store_calls()


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("call", store_calls())
def test_a_wrapper_forwards_every_call_unchanged(wrapper: str, call: str) -> None:
    inner = Recorder()
    store = WRAPPERS[wrapper](inner)
    assert (store.inline_metadata, store.device_memory) == (True, frozenset({"cpu", "npu"}))
    assert store.saves_in_memory is True
    args = _arguments(call)
    answer = getattr(store, call)(*args)
    if call in NEVER_FORWARDED:
        assert (inner.calls, answer) == ([], None)
        return
    if call in KEPT_BACK.get(wrapper, set()):
        assert inner.calls == []
        return
    assert [name for name, _ in inner.calls] == [call]
    for got, sent in zip(inner.calls[0][1], args, strict=True):
        assert got is sent
    if call in ANSWERED:
        assert answer is inner.answers[call]


# -- a wrapped arena keeps a prompt's head through the engine's calls ----------------------------

BLOCK = 16  # tokens per block, one block per chunk


@pytest.fixture(params=sorted(WRAPPERS))
def wrapped(request: pytest.FixtureRequest, store_name: str) -> Iterator[StoreWrapper]:
    """The store ``store_name`` with room for SMALL_OBJECTS objects, in a wrapper."""
    inner = make_store(store_name, SMALL_CAPACITY)
    yield WRAPPERS[request.param](inner)
    dispose(inner)


def _engine(store: Store) -> kvflow.TransferEngine:
    """An engine whose one-block chunks are objects of exactly OBJ_BYTES."""
    caches = make_caches(2, 8, (OBJ_BYTES // 2,), torch.uint8, seed=3)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK)
    assert layout.object_bytes(1) == OBJ_BYTES
    return kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1))


@pytest.mark.arena("watches the eviction order")
@pytest.mark.parametrize("carrier", ["save", "load", "lookup"])
async def test_eviction_context_reaches_a_wrapped_store(
    wrapped: StoreWrapper, carrier: str
) -> None:
    """A prompt of SMALL_OBJECTS chunks fills the pool, its tail used last. One call that names
    the head as context (the ``carrier``: the engine's save or load of the tail, or a lookup as
    the vLLM scheduler makes it) leaves the head the most recent, so the next object evicts the
    prompt's last chunk. Had the wrapper dropped the context, it would evict the first."""
    tokens = np.random.default_rng(5).integers(0, 1000, SMALL_OBJECTS * BLOCK)
    hashes = chunk_hashes(tokens, BLOCK)
    head, tail = tuple(hashes[:2]), tuple(hashes[2:])
    async with _engine(wrapped) as engine:
        keys = engine.keyspace.keys(hashes)
        tail_blocks = np.arange(2, SMALL_OBJECTS)
        assert (await engine.save(tokens[: 2 * BLOCK], np.arange(2))).ok
        assert (await engine.save(kvflow.ChunkHashes(tail), tail_blocks)).ok  # no context
        assert wrapped.lookup(keys[2:]).all()  # the tail the most recently used
        context = kvflow.ChunkHashes(tail, preceding=head)
        if carrier == "save":  # the tail again: EXISTS, touched with its context at the commit
            assert (await engine.save(context, tail_blocks)).ok
        elif carrier == "load":
            assert (await engine.load(context, tail_blocks)).ok
        else:
            assert wrapped.lookup_with_context(keys[2:], keys[:2]).all()
        other = np.random.default_rng(6).integers(1000, 2000, BLOCK)
        assert (await engine.save(other, np.arange(6, 7))).ok  # the pool is full: one goes
    usage = wrapped.usage()
    assert usage is not None and usage.evictions == 1  # usage is forwarded too
    assert wrapped.inner.lookup(keys).tolist() == [True, True, True, False]


def test_usage_of_a_store_that_keeps_none_is_none() -> None:
    class Plain(Recorder):
        usage = Store.usage

    assert StoreWrapper(Plain()).usage() is None
    assert isinstance(StoreWrapper(kvflow.LocalStore("1MiB")).usage(), StoreUsage)
    assert StoreWrapper(kvflow.LocalStore("1MiB")).contents_epoch() is None  # not known
