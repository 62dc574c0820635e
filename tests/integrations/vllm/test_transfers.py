"""The worker's transfers without vLLM: a finished save is counted by its chunks' statuses
(a tail by its own blocks); a dropped transfer is waited for until none of its copies runs any
more (``close(wait=True)``), and one whose copy outlives the engine's grace stops the worker's
transfers for good. A copy held at a gate the test opens stands for the straggler."""

from __future__ import annotations

import collections
import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvflow
from kvflow.abc import Direction
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.planner import Transfer
from kvflow.integrations.vllm.transfers import Transfers
from tests.support.caches import make_caches
from tests.support.gates import Gate
from tests.support.wrappers import WrappedStore

BS = 16
TOKENS = np.arange(2 * BS)
# the engine's grace (stop_grace) is a second: a copy held at a gate soon outlives it
SHORT = kvflow.EngineConfig(
    chunk_blocks=1, prefetch_layers=1, copy_timeout_s=0.05, op_timeout_s=0.5
)


@pytest.fixture
def setup() -> Iterator[tuple[WrappedStore, kvflow.SyncTransferEngine, Transfers]]:
    store = WrappedStore(kvflow.LocalStore("8MiB"))
    layout = kvflow.KVLayout.from_tensors(make_caches(3), block_size=BS)
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1)) as e:
        assert e.save(TOKENS, [0, 1]).ok  # the default timeouts: a stall fails no set-up
    engine = kvflow.SyncTransferEngine(layout, store, SHORT)
    group: Any = None  # a drop needs no cache group
    transfers = Transfers(ConnectorConfig(), group, stats=None)  # type: ignore[arg-type]
    transfers.engine = engine
    yield store, engine, transfers
    engine.close()
    store.close()


def test_a_dropped_load_whose_copies_ended_keeps_the_engine(
    setup: tuple[WrappedStore, kvflow.SyncTransferEngine, Transfers],
) -> None:
    store, engine, transfers = setup
    handle = engine.start_load([(TOKENS, [6, 7])])
    handle.wait_layer(0, timeout=60)
    transfers.drop(handle, "load")
    assert transfers.engine is engine
    assert handle.done() and store.usage().leases == 0


def test_a_dropped_load_whose_copy_outlives_the_grace_stops_the_transfers(
    setup: tuple[WrappedStore, kvflow.SyncTransferEngine, Transfers],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, engine, transfers = setup
    gate = Gate()
    store.before_copy = lambda d, *a: gate() if d == Direction.FROM_POOL else None
    handle = engine.start_load([(TOKENS, [6, 7])])
    assert gate.reached.wait(60)  # layer 0's copy runs, held at the gate
    with caplog.at_level(logging.CRITICAL, logger="kvflow"):
        transfers.drop(handle, "load")
    assert transfers.engine is None  # vLLM may reuse the blocks the copy would touch
    assert gate.held == 1 and gate.passed == 0  # it was still running
    assert "still running past its grace" in caplog.text
    gate.set()


def test_a_load_result_that_came_before_its_straggler_waits_for_it(
    setup: tuple[WrappedStore, kvflow.SyncTransferEngine, Transfers],
) -> None:
    """A copy past its timeout fails its chunks and the result comes out at once, while the copy
    may still write the blocks. The result is handed back only once the copy has returned (the
    test opens the gate when the worker starts waiting for it), so vLLM never reuses a block
    a straggler still writes."""
    store, engine, transfers = setup
    gate = Gate()
    store.before_copy = lambda d, *a: gate() if d == Direction.FROM_POOL else None
    handle = engine.start_load([(TOKENS, [6, 7])])
    assert gate.reached.wait(60)  # layer 0's copy runs, held at the gate
    close = handle.close
    waited: list[bool] = []

    def close_opening_the_gate(wait: bool = False) -> bool:
        waited.append(wait)
        gate.set()  # the straggler returns while the worker waits for it
        return close(wait)

    handle.close = close_opening_the_gate  # type: ignore[method-assign]
    result = transfers.result(handle, "load")
    assert result is not None and not result.ok  # its chunks failed: vLLM recomputes them
    assert waited == [True] and gate.passed >= 1 and gate.held == 0
    assert handle.done() and store.usage().leases == 0
    assert transfers.engine is engine  # the copy returned within the grace


def test_an_engine_stopped_for_good_is_still_closed_at_shutdown(
    setup: tuple[WrappedStore, kvflow.SyncTransferEngine, Transfers],
) -> None:
    store, engine, transfers = setup
    gate = Gate()
    store.before_copy = lambda d, *a: gate() if d == Direction.FROM_POOL else None
    handle = engine.start_load([(TOKENS, [6, 7])])
    assert gate.reached.wait(60)
    transfers.drop(handle, "load")  # past the grace: stopped for good
    assert transfers.engine is None
    gate.set()  # the straggler returns
    transfers.close()
    with pytest.raises(kvflow.ClosedError):
        engine.lookup(TOKENS)


class _Counts:
    """What ``Transfers`` needs of vLLM's stats interval (``metrics.StatsInterval``, which
    imports vLLM): ``update()`` yields an object with the counters in ``data``."""

    def __init__(self) -> None:
        self.data: collections.Counter[str] = collections.Counter()
        self.backlogs: list[int] = []

    @contextlib.contextmanager
    def update(self) -> Iterator[_Counts]:
        yield self

    def record_save_backlog(self, layers: int) -> None:
        self.backlogs.append(layers)


def test_a_finished_save_counts_a_tails_own_tokens_and_whole_chunks_bytes() -> None:
    """Two requests in one save: one whole chunk, then a chunk and a one-block tail. Saved
    tokens count the tail's one block (not its padding), saved bytes every chunk's blocks (the
    padding is copied); the same save again finds every chunk there and counts it skipped."""
    layout = kvflow.KVLayout.from_tensors(make_caches(3), block_size=BS)
    group: Any = types.SimpleNamespace(chunk_blocks=2, block_size=BS)
    counts = _Counts()
    config = ConnectorConfig(op_timeout_s=10)
    transfers = Transfers(config, group, stats=counts)  # type: ignore[arg-type]
    transfers.block_bytes = 100  # one block, every layer: any figure counts the same way
    first, second = np.arange(4 * BS), np.arange(1000, 1000 + 4 * BS)
    plan = [
        Transfer("a", (b"a0",), (0, 1), first_chunk=0),
        Transfer("b", (b"b0", b"b1"), (2, 3, 4, 5), first_chunk=0, tail=1),
    ]
    requests = [(first[: 2 * BS], [0, 1]), (second, [2, 3, 4, 5])]
    config = kvflow.EngineConfig(chunk_blocks=2)
    with kvflow.SyncTransferEngine(layout, kvflow.LocalStore("8MiB"), config) as engine:
        for _ in range(2):
            handle = engine.start_save(requests)
            for layer in range(3):
                handle.layer_written(layer)
            transfers.finish_save(handle, plan)
    d = counts.data
    assert d["saves"] == 2 and len(counts.backlogs) == 2
    assert d["saved_tokens"] == (2 + 2 + 1) * BS  # the tail's padding block is not counted
    assert d["saved_bytes"] == 3 * 2 * 100  # three chunks of two blocks, padding included
    assert d["save_skipped_tokens"] == (2 + 2 + 1) * BS  # the second save: all there
    assert d["save_failed_tokens"] == d["save_failed_chunks"] == 0


def test_a_save_left_running_ends_only_where_it_must() -> None:
    """A save left to end beside the next step (``finish_save(wait=False)``; its copies held at
    a gate on the copy thread) is neither waited for nor counted at the start of a step that
    loads nothing and freed only other requests' blocks; a step that freed its request ends
    it, counted by the statuses its chunks ended with, and so does one that loads. A second
    one left running ends the first before it; closing ends the last. (A wait that should not
    happen fails the test at ``op_timeout_s``, the gate still closed.)"""
    layout = kvflow.KVLayout.from_tensors(make_caches(3), block_size=BS)
    group: Any = types.SimpleNamespace(chunk_blocks=1, block_size=BS)
    counts = _Counts()
    config = ConnectorConfig(op_timeout_s=10)
    transfers = Transfers(config, group, stats=counts)  # type: ignore[arg-type]
    store = WrappedStore(kvflow.LocalStore("8MiB"))
    gate = Gate()
    store.before_copy = lambda d, *a: gate() if d == Direction.TO_POOL else None
    # the copies on the copy thread (not inline, not deferred): the gate holds that thread
    engine_config = kvflow.EngineConfig(
        chunk_blocks=1, inline_saves=False, deferred_saves=False, save_backlog=8
    )
    engine = transfers.engine = kvflow.SyncTransferEngine(layout, store, engine_config)

    def left_running(req_id: str, tokens: np.ndarray, blocks: list[int]) -> Any:
        handle = engine.start_save([(tokens, blocks)])
        for layer in range(3):
            handle.layer_written(layer)
        hashes = tuple(f"{req_id}{i}".encode() for i in range(len(blocks)))
        plan = [Transfer(req_id, hashes, tuple(blocks), first_chunk=0)]
        transfers.finish_save(handle, plan, wait=False)
        return handle

    try:
        first = left_running("a", np.arange(BS), [0])
        assert gate.reached.wait(60)  # its first copy runs, held at the gate
        transfers.before_forward({"b"}, loads=False)  # another request's blocks were freed
        assert counts.data["saves"] == 0 and gate.passed == 0 and not first.done()

        gate.set()
        transfers.before_forward({"a", "b"}, loads=False)
        assert first.done() and counts.data["saves"] == 1
        assert counts.data["saved_tokens"] == BS and counts.data["save_failed_chunks"] == 0

        loading = left_running("e", np.arange(300, 300 + BS), [4])
        transfers.before_forward(set(), loads=True)  # nothing freed, but the step loads
        assert loading.done() and counts.data["saves"] == 2

        second = left_running("c", np.arange(100, 100 + 2 * BS), [1, 2])
        assert counts.data["saves"] == 2  # neither waited for nor counted yet
        left_running("d", np.arange(200, 200 + BS), [3])  # ends the one before it first
        assert second.done() and counts.data["saves"] == 3
        assert counts.data["saved_tokens"] == BS + BS + 2 * BS
        transfers.close()  # ends the last, then closes the engine
        assert counts.data["saves"] == 4 and store.usage().leases == 0
        with kvflow.SyncTransferEngine(layout, store, engine_config) as check:
            assert check.lookup(np.arange(200, 200 + BS)) == BS  # d is in the pool
    finally:
        gate.set()
        transfers.close()
        store.close()
