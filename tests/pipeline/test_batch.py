"""Batch planning: validation and keying of requests, and splitting results per request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import (
    SKIP_BLOCK,
    ChunkHashes,
    ChunkStatus,
    InvalidArgumentError,
    KVLayout,
    RequestResult,
    TransferResult,
)
from kvflow.keys import KeySpace, chunk_hashes
from kvflow.pipeline.batch import BatchPlan, plan_batch

BLOCK_SIZE = 4
CHUNK_BLOCKS = 2
CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.from_tensors([torch.zeros(16, 4, 8) for _ in range(2)], block_size=BLOCK_SIZE)


@pytest.fixture
def keyspace(layout: KVLayout) -> KeySpace:
    return KeySpace.for_layout(
        model="m",
        layout_fingerprint=layout.fingerprint(),
        chunk_blocks=CHUNK_BLOCKS,
        num_layers=layout.num_layers,
        rank=0,
    )


def _tokens(n: int, seed: int = 0) -> list[int]:
    values: list[int] = np.random.default_rng(seed).integers(0, 1000, size=n).tolist()
    return values


def _keys(keyspace: KeySpace, tokens: list[int]) -> list[str]:
    return keyspace.keys(chunk_hashes(np.array(tokens, np.int64), CHUNK_TOKENS))


def _plan(layout: KVLayout, keyspace: KeySpace, requests: object, *, load: bool) -> BatchPlan:
    return plan_batch(layout, keyspace, requests, CHUNK_BLOCKS, load=load)


# -- planning ---------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [True, False])
def test_plan_keys_the_full_chunks_of_one_request(
    layout: KVLayout, keyspace: KeySpace, load: bool
) -> None:
    tokens = _tokens(20)  # 5 blocks, 2 full chunks of 8 tokens, 4 tokens left over

    plan = _plan(layout, keyspace, [(tokens, [9, 3, 4, 7, 1])], load=load)

    assert plan.num_chunks == 2
    assert list(plan.keys) == _keys(keyspace, tokens)
    assert plan.block_ids.dtype == np.int64
    assert plan.block_ids.tolist() == [9, 3, 4, 7]
    assert plan.chunks_per_request == (2,)
    assert plan.chunk_blocks == CHUNK_BLOCKS
    assert plan.block_size == BLOCK_SIZE


def test_plan_keeps_requests_in_order(layout: KVLayout, keyspace: KeySpace) -> None:
    a, b, c = _tokens(16, seed=1), _tokens(7, seed=2), _tokens(25, seed=3)

    plan = _plan(
        layout,
        keyspace,
        [(a, [0, 1, 2, 3]), (b, [4, 5]), (c, [6, 7, 8, 9, 10, 11, 12])],
        load=True,
    )

    assert plan.chunks_per_request == (2, 0, 3)
    assert list(plan.keys) == _keys(keyspace, a) + _keys(keyspace, c)
    assert plan.block_ids.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]


def test_plan_of_requests_sharing_a_prefix_repeats_its_keys(
    layout: KVLayout, keyspace: KeySpace
) -> None:
    shared = _tokens(8, seed=4)
    a, b = [*shared, *_tokens(8, seed=5)], [*shared, *_tokens(8, seed=6)]

    plan = _plan(layout, keyspace, [(a, [0, 1, 2, 3]), (b, [4, 5, 6, 7])], load=True)

    assert plan.keys[0] == plan.keys[2]
    assert plan.keys[1] != plan.keys[3]


def test_plan_of_no_requests_is_empty(layout: KVLayout, keyspace: KeySpace) -> None:
    plan = _plan(layout, keyspace, [], load=True)

    assert plan.num_chunks == 0
    assert plan.keys == ()
    assert plan.block_ids.dtype == np.int64
    assert plan.block_ids.shape == (0,)
    assert plan.chunks_per_request == ()


def test_plan_accepts_empty_requests(layout: KVLayout, keyspace: KeySpace) -> None:
    plan = _plan(layout, keyspace, [([], [])], load=True)

    assert plan.num_chunks == 0
    assert plan.chunks_per_request == (0,)


def test_plan_accepts_numpy_and_torch_inputs_and_a_tuple_of_requests(
    layout: KVLayout, keyspace: KeySpace
) -> None:
    tokens = _tokens(16)

    plan = _plan(
        layout,
        keyspace,
        (
            [np.array(tokens, np.int32), np.array([5, 6, 7, 8], np.int64)],
            (torch.tensor(tokens), torch.tensor([9, 10, 11, 12])),
        ),
        load=True,
    )

    assert list(plan.keys) == _keys(keyspace, tokens) * 2
    assert plan.block_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]


def test_chunk_block_ids_returns_the_blocks_of_the_given_chunks(
    layout: KVLayout, keyspace: KeySpace
) -> None:
    plan = _plan(layout, keyspace, [(_tokens(24), [3, 4, 10, 11, 0, 1])], load=True)

    assert plan.chunk_block_ids(np.array([2, 0])).tolist() == [0, 1, 3, 4]
    assert plan.chunk_block_ids(np.array([1])).tolist() == [10, 11]
    assert plan.chunk_block_ids(np.array([], np.int64)).tolist() == []


# -- planning: refusals -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_tokens", "n_blocks"), [(20, 4), (20, 6), (16, 5), (16, 3), (1, 0), (0, 1)]
)
def test_plan_refuses_a_block_count_other_than_ceil_tokens_over_block_size(
    layout: KVLayout, keyspace: KeySpace, n_tokens: int, n_blocks: int
) -> None:
    need = -(-n_tokens // BLOCK_SIZE)
    requests = [(_tokens(8), [0, 1]), (_tokens(n_tokens), list(range(2, 2 + n_blocks)))]

    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, requests, load=False)

    assert info.value.argument == "requests[1].block_ids"
    assert info.value.value == f"{n_blocks} blocks"
    assert f"need {need} blocks" in str(info.value)


@pytest.mark.parametrize("load", [True, False])
def test_plan_refuses_a_block_repeated_within_a_request(
    layout: KVLayout, keyspace: KeySpace, load: bool
) -> None:
    requests = [(_tokens(8), [6, 7]), (_tokens(16), [0, 1, 2, 1])]

    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, requests, load=load)

    assert info.value.argument == "requests[1].block_ids"
    assert info.value.value == [1]
    assert ("would write two chunks" in info.value.reason) == load


@pytest.mark.parametrize("load", [True, False])
def test_plan_refuses_repeated_blocks_given_as_chunk_hashes(
    layout: KVLayout, keyspace: KeySpace, load: bool
) -> None:
    hashes = ChunkHashes(chunk_hashes(np.array(_tokens(16), np.int64), CHUNK_TOKENS))

    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, [(hashes, [3, 4, 4, 3])], load=load)

    assert info.value.argument == "requests[0].block_ids"
    assert info.value.value == [3, 4]


def test_load_refuses_a_block_shared_between_requests(layout: KVLayout, keyspace: KeySpace) -> None:
    requests = [(_tokens(8), [0, 5]), (_tokens(8, seed=1), [6, 5])]

    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, requests, load=True)

    assert info.value.argument == "requests[1].block_ids"
    assert info.value.value == [5]
    assert "requests[0]" in info.value.reason


def test_save_allows_blocks_shared_between_requests(layout: KVLayout, keyspace: KeySpace) -> None:
    requests = [(_tokens(16), [0, 1, 2, 3]), (_tokens(16, seed=1), [1, 0, 2, 4])]

    plan = _plan(layout, keyspace, requests, load=False)

    assert plan.block_ids.tolist() == [0, 1, 2, 3, 1, 0, 2, 4]
    assert plan.chunks_per_request == (2, 2)


def test_load_ignores_repeats_in_blocks_outside_full_chunks(
    layout: KVLayout, keyspace: KeySpace
) -> None:
    # the fifth block holds the partial tail, which a load never writes
    plan = _plan(layout, keyspace, [(_tokens(19), [0, 1, 2, 3, 0])], load=True)

    assert plan.block_ids.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("requests", ["requests", b"ab", None, 5, {"a": 1}, iter([])])
def test_plan_refuses_requests_that_are_not_a_list(
    layout: KVLayout, keyspace: KeySpace, requests: object
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, requests, load=True)

    assert info.value.argument == "requests"


@pytest.mark.parametrize(
    "request_", [([1, 2, 3, 4],), ([1, 2, 3, 4], [0], [1]), "ab", None, 7, {"t": 1, "b": 2}]
)
def test_plan_refuses_requests_that_are_not_pairs(
    layout: KVLayout, keyspace: KeySpace, request_: object
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, [(_tokens(4), [0]), request_], load=True)

    assert info.value.argument == "requests[1]"


@pytest.mark.parametrize("tokens", [[1.0, 2.0], [-1, 2], [[1, 2]]])
def test_plan_refuses_bad_token_ids_naming_the_request(
    layout: KVLayout, keyspace: KeySpace, tokens: object
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, [(tokens, [0])], load=True)

    assert info.value.argument == "requests[0].token_ids"


@pytest.mark.parametrize("blocks", [[16], [-2], [0.0], [[0]]])
@pytest.mark.parametrize("load", [True, False])
def test_plan_refuses_bad_block_ids_naming_the_request(
    layout: KVLayout, keyspace: KeySpace, blocks: object, load: bool
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, [(_tokens(4), [0]), (_tokens(4), blocks)], load=load)

    assert info.value.argument == "requests[1].block_ids"


def test_only_a_load_may_skip_places(layout: KVLayout, keyspace: KeySpace) -> None:
    tokens = _tokens(16)
    with pytest.raises(InvalidArgumentError) as info:
        _plan(layout, keyspace, [(tokens, [SKIP_BLOCK, 1, 2, 3])], load=False)
    assert info.value.argument == "requests[0].block_ids"
    assert info.value.value == SKIP_BLOCK

    # skipped places repeat freely, in one request and across requests
    plan = _plan(
        layout,
        keyspace,
        [(tokens, [SKIP_BLOCK, SKIP_BLOCK, 2, 3]), (_tokens(8, 1), [SKIP_BLOCK, 5])],
        load=True,
    )
    assert plan.block_ids.tolist() == [SKIP_BLOCK, SKIP_BLOCK, 2, 3, SKIP_BLOCK, 5]
    assert plan.moved_blocks(np.arange(plan.num_chunks)) == 3
    assert plan.moved_blocks(np.array([0])) == 0


def test_a_results_block_ids_leave_out_skipped_places(layout: KVLayout, keyspace: KeySpace) -> None:
    plan = _plan(layout, keyspace, [(_tokens(24), [SKIP_BLOCK, 1, 2, 3, 4, 5])], load=True)
    result = plan.result(np.array([ChunkStatus.MISSING, ChunkStatus.OK, ChunkStatus.FAILED]))

    only = result.requests[0]
    assert only.failed_block_ids.tolist() == [1, 4, 5]
    assert only.ok_block_ids.tolist() == [2, 3]
    assert result.failed_block_ids.tolist() == [1, 4, 5]


# -- results ----------------------------------------------------------------------------------


def test_result_splits_statuses_per_request(layout: KVLayout, keyspace: KeySpace) -> None:
    plan = _plan(
        layout,
        keyspace,
        [(_tokens(16), [0, 1, 2, 3]), (_tokens(4), [4]), (_tokens(24), [5, 6, 7, 8, 9, 10])],
        load=True,
    )
    status = np.array([ChunkStatus.OK, ChunkStatus.MISSING, 0, 1, 2], np.int64)

    result = plan.result(status)

    assert isinstance(result, TransferResult)
    assert len(result.requests) == 3
    first, empty, last = result.requests
    assert first.block_ids.tolist() == [0, 1, 2, 3]
    assert first.chunk_status.tolist() == [0, 2]
    assert empty.block_ids.tolist() == []
    assert empty.chunk_status.tolist() == []
    assert last.block_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert last.chunk_status.tolist() == [0, 1, 2]
    assert {r.chunk_blocks for r in result.requests} == {CHUNK_BLOCKS}
    assert {r.block_size for r in result.requests} == {BLOCK_SIZE}
    # the result keeps its own copy of the statuses
    status[:] = ChunkStatus.FAILED
    assert first.chunk_status.tolist() == [0, 2]


def test_result_of_an_empty_plan(layout: KVLayout, keyspace: KeySpace) -> None:
    result = _plan(layout, keyspace, [], load=True).result(np.zeros(0, np.int64))

    assert result.requests == ()
    assert result.ok
    assert result.failed_block_ids.tolist() == []


def _request(*statuses: ChunkStatus, chunk_blocks: int = 2, block_size: int = 4) -> RequestResult:
    n = len(statuses)
    return RequestResult(
        block_ids=np.arange(100, 100 + n * chunk_blocks, dtype=np.int64),
        chunk_status=np.array([int(s) for s in statuses], np.int64),
        chunk_blocks=chunk_blocks,
        block_size=block_size,
    )


S = ChunkStatus


@pytest.mark.parametrize(
    ("statuses", "chunks"),
    [
        ((S.OK, S.OK, S.OK), 3),
        ((S.OK, S.OK, S.FAILED, S.OK), 2),
        ((S.EXISTS, S.OK, S.MISSING), 2),
        ((S.MISSING, S.OK), 0),
        ((S.NO_SPACE, S.OK), 0),
        ((S.OK, S.NO_SPACE), 1),
        ((), 0),
    ],
)
def test_ok_tokens_counts_the_leading_run_of_good_chunks(
    statuses: tuple[ChunkStatus, ...], chunks: int
) -> None:
    assert _request(*statuses, chunk_blocks=2, block_size=4).ok_tokens == chunks * 8
    assert _request(*statuses, chunk_blocks=3, block_size=16).ok_tokens == chunks * 48


def test_failed_block_ids_are_the_failed_and_missing_chunks() -> None:
    result = _request(S.OK, S.FAILED, S.EXISTS, S.MISSING, S.NO_SPACE)

    assert result.failed_block_ids.tolist() == [102, 103, 106, 107]
    assert result.ok_block_ids.tolist() == [100, 101]


def test_blocks_with_selects_chunks_by_status_in_order() -> None:
    result = _request(S.NO_SPACE, S.OK, S.EXISTS, S.OK, S.NO_SPACE, chunk_blocks=2)

    assert result.blocks_with(S.OK).tolist() == [102, 103, 106, 107]
    assert result.blocks_with(S.NO_SPACE, S.EXISTS).tolist() == [100, 101, 104, 105, 108, 109]
    assert result.blocks_with(S.FAILED).tolist() == []
    assert result.blocks_with().tolist() == []
    assert result.count(S.OK) == 2
    assert result.count(S.NO_SPACE) == 2
    assert result.count(S.MISSING) == 0


def test_blocks_with_of_a_request_without_chunks() -> None:
    result = _request()

    assert result.blocks_with(S.OK).tolist() == []
    assert result.failed_block_ids.tolist() == []
    assert result.ok_tokens == 0


def test_transfer_result_aggregates_requests() -> None:
    good = _request(S.OK, S.EXISTS, S.NO_SPACE)
    bad = _request(S.OK, S.MISSING)

    assert TransferResult((good,)).ok
    assert not TransferResult((good, bad)).ok
    combined = TransferResult((bad, good, bad))
    assert combined.failed_block_ids.tolist() == [102, 103, 102, 103]
    assert combined.count(S.OK) == 3
    assert combined.count(S.MISSING) == 2
    assert repr(combined) == (
        "TransferResult(requests=3, chunks={'OK': 3, 'MISSING': 2, 'EXISTS': 1, 'NO_SPACE': 1})"
    )


def test_preceding_chunk_hashes_become_the_plan_context_and_need_no_blocks(
    layout: KVLayout, keyspace: KeySpace
) -> None:
    """Each request's preceding chunks, in request order; token-id requests name none (they
    name their whole prefix already), nor does a request that moves no chunk."""
    h = chunk_hashes(np.array(_tokens(32), np.int64), CHUNK_TOKENS)  # 4 chunks
    g = chunk_hashes(np.array(_tokens(24, seed=3), np.int64), CHUNK_TOKENS)  # 3 chunks
    requests = [
        (ChunkHashes(tuple(h[2:]), preceding=tuple(h[:2])), [0, 1, 2, 3]),
        (_tokens(8, seed=5), [4, 5]),
        (ChunkHashes((), preceding=tuple(g[:1])), []),
        (ChunkHashes((g[2],), preceding=tuple(g[:2])), [6, 7]),
    ]

    plan = _plan(layout, keyspace, requests, load=False)

    assert plan.keys == tuple(
        keyspace.keys(
            [*h[2:], *chunk_hashes(np.array(_tokens(8, seed=5), np.int64), CHUNK_TOKENS), g[2]]
        )
    )
    assert plan.context == tuple(keyspace.keys([*h[:2], *g[:2]]))
    assert plan.block_ids.tolist() == list(range(8))
