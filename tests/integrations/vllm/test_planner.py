"""ChunkPlanner, the scheduler side of the vLLM connector, without vLLM.

What is tested: ``matched_tokens`` makes one batched pool lookup of exactly the chunk hashes from
the one holding token ``num_computed`` and returns a run of whole chunks that stops at the first
miss and never covers the last prompt token (where vLLM's hit ends inside a chunk, the load skips
the blocks vLLM holds); ``allocated`` turns a hit into the next step's load (or cancels it);
``step`` loads into the right blocks and saves each prompt chunk exactly once, with its blocks,
across chunked prefill, decode, and preemption; with a sliding window, a hit needs (and a load
moves) only the chunks of the window before its end, vLLM's null block is never written, and a
chunk whose first blocks the window dropped is not saved; chunks vLLM's own prefix cache
provides are not saved again when the planner saw them in the pool within ``RECENT_S`` (and are
saved when it did not, or longer ago, or a lookup found them gone); ``finished`` forgets a
request.

The pool is a python set of stored chunk hashes. Block hashes are prefix-chained like vLLM's, so
prompts that share a prefix share its block hashes.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvflow import SKIP_BLOCK
from kvflow.integrations.vllm.planner import (
    RECENT_S,
    REUSE_S,
    ChunkPlanner,
    Transfer,
)
from tests.support.processes import REPO
from tests.support.vllm_planning import (
    BS,
    CB,
    CT,
    Clock,
    FakePool,
    FakeRequest,
    chained,
    expected,
    match,
    new,
    per_chunk,
    planner,
    request,
    running,
    stored,
    vllm_table,
    words,
)

# -- matched_tokens: one batched lookup --------------------------------------------------------


def test_full_hit_is_one_lookup_of_every_chunk_hash() -> None:
    pool = FakePool()
    req = request("r", 5 * CT + 1)  # 5 whole chunks and one token
    pool.store(req, range(5))
    p = planner(pool)

    assert match(p, req) == 5 * CT
    assert pool.calls == [[req.chunk_hash(c) for c in range(5)]]


@pytest.mark.parametrize("first_chunk", [1, 2, 4])
def test_lookup_starts_at_num_computed(first_chunk: int) -> None:
    pool, req, p = stored("r", 5 * CT + 1, chunks=5)

    assert match(p, req, first_chunk * CT) == (5 - first_chunk) * CT
    assert pool.calls == [[req.chunk_hash(c) for c in range(first_chunk, 5)]]


@pytest.mark.parametrize(
    ("stored", "hit_chunks"),
    [({0, 1, 3, 4}, 2), ({1, 2, 3, 4}, 0), ({0}, 1), (set(), 0), ({0, 1, 2, 3}, 4)],
)
def test_partial_hit_stops_at_the_first_miss(stored: set[int], hit_chunks: int) -> None:
    pool = FakePool()
    req = request("r", 5 * CT + 1)
    pool.store(req, stored)
    p = planner(pool)

    assert match(p, req) == hit_chunks * CT
    assert len(pool.calls) == 1  # the whole run in one call, even past the first miss


def test_a_waiting_request_reuses_its_answer_for_reuse_s() -> None:
    """vLLM asks again about a request it could not schedule, at every step: the pool is asked
    once per REUSE_S, and again at once when vLLM's own hit changed."""
    pool = FakePool()
    req = request("r", 3 * CT + 1)
    pool.store(req, range(3))
    clock = Clock()
    p = planner(pool, clock=clock)

    assert match(p, req) == 3 * CT
    pool.stored.clear()
    clock.now += REUSE_S / 2
    assert match(p, req) == 3 * CT  # the answer of REUSE_S / 2 ago
    assert len(pool.calls) == 1
    assert match(p, req, CT) == 0  # vLLM's own hit grew: asked afresh
    assert len(pool.calls) == 2
    clock.now += REUSE_S
    assert match(p, req) == 0  # REUSE_S later: asked afresh
    assert len(pool.calls) == 3


@pytest.mark.parametrize(
    ("prompt_tokens", "hit_chunks"),
    [
        (4 * CT, 3),  # exactly 4 chunks: the last one holds the last token
        (4 * CT + 1, 4),
        (4 * CT + BS, 4),
        (5 * CT - 1, 4),  # the 5th chunk is not full
        (CT + 1, 1),
    ],
)
def test_a_hit_never_covers_the_last_prompt_token(prompt_tokens: int, hit_chunks: int) -> None:
    pool = FakePool()
    req = request("r", prompt_tokens)
    pool.store(req, range(len(req.hashes) // CB))  # every full chunk is stored
    p = planner(pool)

    tokens = match(p, req)

    assert tokens == hit_chunks * CT
    assert tokens < prompt_tokens
    assert pool.calls == [[req.chunk_hash(c) for c in range(hit_chunks)]]


def test_a_prompt_of_exactly_k_chunks_from_an_aligned_start() -> None:
    pool, req, p = stored("r", 4 * CT, chunks=4)

    assert match(p, req, 2 * CT) == CT  # chunk 2 only: chunk 3 holds the last token
    assert pool.calls == [[req.chunk_hash(2)]]


@pytest.mark.parametrize("prompt_tokens", [1, BS, CT])
def test_a_prompt_of_at_most_one_chunk_never_hits(prompt_tokens: int) -> None:
    pool = FakePool()
    req = request("r", prompt_tokens)
    pool.store(req, range(len(req.hashes) // CB))
    p = planner(pool)

    assert match(p, req) == 0
    assert all(call == [] for call in pool.calls)  # nothing to ask the pool about


@pytest.mark.parametrize("num_computed", [1, CT - 1, 3 * CT + 3])
def test_num_computed_not_block_aligned_hits_nothing(num_computed: int) -> None:
    pool, req, p = stored("r", 5 * CT + 1, chunks=5)

    assert match(p, req, num_computed) == 0
    assert pool.calls == []
    p.allocated(req.req_id, 2 * CT)  # even if vLLM allocated for more: no hit, no load
    loads, _ = p.step([new(req, range(100, 111), num_computed, req.prompt_tokens - num_computed)])
    assert loads == []


@pytest.mark.parametrize("first_chunk", [0, 1, 3])
def test_a_prefix_cache_hit_ending_inside_a_chunk_loads_the_rest_of_it(first_chunk: int) -> None:
    """vLLM's own hit counts blocks: it ends one block into chunk ``first_chunk``. The load
    starts with that chunk, its first block SKIP_BLOCK (vLLM holds it, maybe shared)."""
    pool, req, p = stored("r", 5 * CT + 1, chunks=5)
    computed = first_chunk * CT + BS

    assert match(p, req, computed) == 5 * CT - computed
    assert pool.calls == [[req.chunk_hash(c) for c in range(first_chunk, 5)]]
    assert pool.preceding == [[req.chunk_hash(c) for c in range(first_chunk)]]
    p.allocated(req.req_id, 5 * CT - computed)
    blocks = list(range(100, 111))
    loads, saves = p.step([new(req, blocks, 5 * CT, 1)])  # vLLM's hit and the load computed

    (load,) = loads
    assert load.first_chunk == first_chunk
    assert load.hashes == tuple(req.chunk_hash(c) for c in range(first_chunk, 5))
    assert load.block_ids == (SKIP_BLOCK, *blocks[first_chunk * CB + 1 : 5 * CB])
    assert saves == []  # the hit and the load cover every whole chunk


def test_a_hit_inside_a_chunk_needs_that_chunk_in_the_pool() -> None:
    pool = FakePool()
    req = request("r", 5 * CT + 1)
    pool.store(req, [0, 2, 3, 4])  # chunk 1 was evicted: vLLM's hit ends inside it
    p = planner(pool)

    assert match(p, req, CT + BS) == 0


def test_vllm_allocating_less_of_a_hit_inside_a_chunk_shortens_the_load() -> None:
    pool, req, p = stored("r", 5 * CT + 1, chunks=5)

    assert match(p, req, CT + BS) == 4 * CT - BS
    p.allocated(req.req_id, 2 * CT)  # the rest of chunk 1, chunk 2, half of chunk 3
    loads, _ = p.step([new(req, range(100, 111), 3 * CT, req.prompt_tokens - 3 * CT)])

    (load,) = loads
    assert load.hashes == (req.chunk_hash(1), req.chunk_hash(2))
    assert load.block_ids == (SKIP_BLOCK, 103, 104, 105)


def test_num_computed_past_the_hit_range_hits_nothing() -> None:
    pool, req, p = stored("r", 3 * CT, chunks=3)

    assert match(p, req, 3 * CT) == 0
    assert all(call == [] for call in pool.calls)


def test_shared_prefix_hits_up_to_the_divergence() -> None:
    pool = FakePool()
    a = FakeRequest("a", 4 * CT + 1, chained(words("sys", 2 * CB) + words("a", 2 * CB)))
    b = FakeRequest("b", 4 * CT + 1, chained(words("sys", 2 * CB) + words("b", 2 * CB)))
    assert a.hashes[: 2 * CB] == b.hashes[: 2 * CB]
    p = planner(pool)
    match(p, a)
    _, saves = p.step([new(a, range(4 * CB + 1), 0, a.prompt_tokens)])
    pool.store_saves(saves)

    assert match(p, b) == 2 * CT  # the shared system prompt; b's own chunks are not stored


def test_load_false_looks_nothing_up_but_still_saves() -> None:
    pool = FakePool()
    req = request("r", 3 * CT + 1)
    pool.store(req, range(3))
    p = planner(pool, load=False)

    assert match(p, req) == 0
    assert pool.calls == []
    p.allocated(req.req_id, 0)
    blocks = list(range(10, 17))
    loads, saves = p.step([new(req, blocks, 0, req.prompt_tokens)])

    assert loads == []
    assert per_chunk(saves) == expected(req, range(3), blocks)


def test_save_false_loads_but_never_saves() -> None:
    pool = FakePool()
    req = request("r", 5 * CT + 1)
    pool.store(req, range(2))
    p = planner(pool, save=False)

    assert match(p, req) == 2 * CT
    p.allocated(req.req_id, 2 * CT)
    blocks = list(range(20, 31))
    loads, saves = p.step([new(req, blocks, 2 * CT, req.prompt_tokens - 2 * CT)])

    assert per_chunk(loads) == expected(req, range(2), blocks)
    assert saves == []
    assert p.take_unsaved_chunks() == 3  # what a kv_consumer computed and did not store
    assert p.take_unsaved_chunks() == 0
    req.decode(1)
    assert p.step([running(req, None, req.prompt_tokens, 1)]) == ([], [])
    assert p.take_unsaved_chunks() == 0


# -- loads ------------------------------------------------------------------------------------


def test_load_carries_the_hit_chunks_blocks() -> None:
    pool = FakePool()
    req = request("r", 5 * CT + 1)  # 10 full blocks + 1 token: 11 blocks
    pool.store(req, range(5))
    p = planner(pool)

    assert match(p, req, CT) == 4 * CT  # chunk 0 computed locally (vLLM's prefix cache)
    p.allocated(req.req_id, 4 * CT)
    blocks = list(range(100, 111))
    loads, saves = p.step([new(req, blocks, 5 * CT, 1)])

    assert loads == [
        Transfer(
            req.req_id,
            tuple(req.chunk_hash(c) for c in range(1, 5)),
            tuple(blocks[1 * CB : 5 * CB]),
            1,
            (req.chunk_hash(0),),
        )
    ]
    assert saves == []  # every prompt chunk is either local or loaded


def test_load_and_save_in_one_step_never_overlap() -> None:
    pool, req, p = stored("r", 5 * CT + 1, chunks=3)

    assert match(p, req) == 3 * CT
    p.allocated(req.req_id, 3 * CT)
    blocks = list(range(50, 61))
    loads, saves = p.step([new(req, blocks, 3 * CT, req.prompt_tokens - 3 * CT)])

    assert per_chunk(loads) == expected(req, range(3), blocks)
    assert per_chunk(saves) == expected(req, range(3, 5), blocks)


def test_a_load_happens_once() -> None:
    pool, req, p = stored("r", 3 * CT + 1, chunks=3)
    match(p, req)
    p.allocated(req.req_id, 3 * CT)
    blocks = list(range(7))

    first, _ = p.step([new(req, blocks, 3 * CT, 1)])
    req.decode(1)
    again, _ = p.step([running(req, None, 3 * CT + 1, 1)])

    assert per_chunk(first) == expected(req, range(3), blocks)
    assert again == []


def test_allocated_zero_cancels_the_load() -> None:
    pool, req, p = stored("r", 3 * CT + 1, chunks=3)

    assert match(p, req) == 3 * CT
    p.allocated(req.req_id, 0)  # vLLM could not give the blocks: it computes everything
    blocks = list(range(30, 37))
    loads, saves = p.step([new(req, blocks, 0, req.prompt_tokens)])

    assert loads == []
    assert per_chunk(saves) == expected(req, range(3), blocks)  # computed, so saved


def test_allocated_fewer_tokens_loads_fewer_chunks() -> None:
    pool, req, p = stored("r", 4 * CT + 1, chunks=4)

    assert match(p, req) == 4 * CT
    p.allocated(req.req_id, 2 * CT)
    blocks = list(range(9))
    loads, saves = p.step([new(req, blocks, 2 * CT, req.prompt_tokens - 2 * CT)])

    assert per_chunk(loads) == expected(req, range(2), blocks)
    assert per_chunk(saves) == expected(req, range(2, 4), blocks)


def test_allocated_less_than_a_chunk_loads_nothing() -> None:
    pool, req, p = stored("r", 3 * CT + 1, chunks=3)

    assert match(p, req) == 3 * CT
    p.allocated(req.req_id, CT - 1)
    blocks = list(range(7))
    loads, saves = p.step([new(req, blocks, 0, req.prompt_tokens)])

    assert loads == []  # not even an empty Transfer
    assert per_chunk(saves) == expected(req, range(3), blocks)


def test_allocated_without_a_hit_loads_nothing() -> None:
    pool = FakePool()
    req = request("r", 3 * CT + 1)
    p = planner(pool)

    assert match(p, req) == 0
    p.allocated(req.req_id, 2 * CT)
    loads, _ = p.step([new(req, range(7), 0, req.prompt_tokens)])

    assert loads == []


def test_a_later_match_replaces_an_unallocated_hit() -> None:
    pool = FakePool()
    req = request("r", 4 * CT + 1)
    pool.store(req, range(4))
    clock = Clock()
    p = planner(pool, clock=clock)

    assert match(p, req) == 4 * CT  # not scheduled this step: no allocation
    pool.stored.discard(req.chunk_hash(1))
    clock.now += REUSE_S
    assert match(p, req) == CT  # a later step asks again
    p.allocated(req.req_id, CT)
    blocks = list(range(9))
    loads, _ = p.step([new(req, blocks, CT, req.prompt_tokens - CT)])

    assert per_chunk(loads) == expected(req, range(1), blocks)


# -- saves ------------------------------------------------------------------------------------


def test_chunked_prefill_saves_each_chunk_once_in_the_step_that_completes_it() -> None:
    pool = FakePool()
    req = request("r", 5 * CT + 1)  # 41 tokens, 11 blocks
    p = planner(pool)
    assert match(p, req) == 0
    blocks = [200 + i for i in range(11)]

    # 12 tokens (3 blocks): chunk 0 completes
    _, s1 = p.step([new(req, blocks[:3], 0, 12)])
    # 4 more tokens (16: chunk 1 completes), one new block
    _, s2 = p.step([running(req, blocks[3:4], 12, 4)])
    # 6 more (22): nothing completes, two new blocks
    _, s3 = p.step([running(req, blocks[4:6], 16, 6)])
    # 2 more (24): chunk 2 completes, no new block
    _, s4 = p.step([running(req, None, 22, 2)])
    # the rest (41): chunks 3 and 4 complete
    _, s5 = p.step([running(req, blocks[6:], 24, 17)])

    assert per_chunk(s1) == expected(req, [0], blocks)
    assert per_chunk(s2) == expected(req, [1], blocks)
    assert s3 == []
    assert per_chunk(s4) == expected(req, [2], blocks)
    assert per_chunk(s5) == expected(req, [3, 4], blocks)


def test_a_save_of_new_chunks_names_the_chunks_before_them() -> None:
    """Each step's save moves only its new chunks and carries the hashes of every chunk before
    them, for the pool's eviction order."""
    pool = FakePool()
    req = request("r", 4 * CT + 1)
    p = planner(pool)
    assert match(p, req) == 0
    assert pool.preceding == [[]]  # looked up from chunk 0: nothing before
    blocks = list(range(100, 109))

    _, s1 = p.step([new(req, blocks[:4], 0, CT)])
    _, s2 = p.step([running(req, blocks[4:], CT, 3 * CT + 1)])

    assert [(t.first_chunk, t.preceding) for t in s1] == [(0, ())]
    assert [(t.first_chunk, t.preceding) for t in s2] == [(1, (req.chunk_hash(0),))]
    assert per_chunk(s2) == expected(req, range(1, 4), blocks)


def test_a_lookup_and_load_after_vllms_cache_name_the_chunks_it_holds() -> None:
    pool, req, p = stored("r", 5 * CT + 1, chunks=5)

    assert match(p, req, 2 * CT) == 3 * CT  # vLLM's cache holds chunks 0 and 1
    assert pool.preceding == [[req.chunk_hash(0), req.chunk_hash(1)]]
    p.allocated(req.req_id, 3 * CT)
    loads, _ = p.step([new(req, list(range(11)), 2 * CT, 1)])

    assert [(t.first_chunk, t.preceding) for t in loads] == [
        (2, (req.chunk_hash(0), req.chunk_hash(1)))
    ]


def test_decode_steps_save_nothing_past_the_prompt() -> None:
    pool = FakePool()
    req = request("r", 2 * CT + 1)  # 17 tokens, 5 blocks
    p = planner(pool)
    match(p, req)
    blocks = list(range(5))
    _, saves = p.step([new(req, blocks, 0, req.prompt_tokens)])
    assert per_chunk(saves) == expected(req, range(2), blocks)

    computed, next_block = req.prompt_tokens, 5
    for _ in range(3 * CT):  # enough decode tokens to fill several chunks
        new_ids = None
        if computed % BS == 0:
            new_ids, next_block = [next_block], next_block + 1
        req.decode(computed + 1 - req.prompt_tokens)
        loads, saves = p.step([running(req, new_ids, computed, 1)])
        assert (loads, saves) == ([], []), computed
        computed += 1


def test_save_generated_saves_each_decode_chunk_once_its_tokens_are_final() -> None:
    """``save_decode_cache``: a chunk of generated tokens is saved in the step after the one
    that computed its last token (the tokens computed before a step are final), once."""
    pool = FakePool()
    req = request("r", 2 * CT + 1)
    p = planner(pool, save_generated=True)
    match(p, req)
    blocks = list(range(5))
    _, saves = p.step([new(req, blocks, 0, req.prompt_tokens)])
    assert per_chunk(saves) == expected(req, range(2), blocks)

    computed, next_block, saved = req.prompt_tokens, 5, {}
    for _ in range(3 * CT):
        new_ids = None
        if computed % BS == 0:
            new_ids, next_block = [next_block], next_block + 1
            blocks += new_ids
        req.decode(computed + 1 - req.prompt_tokens)
        loads, saves = p.step([running(req, new_ids, computed, 1)])
        assert loads == []
        for _, chunk, key, ids in per_chunk(saves):
            assert chunk not in saved and computed >= (chunk + 1) * CT, (chunk, computed)
            saved[chunk] = (key, ids)
        computed += 1

    chunks = (computed - 1) // CT  # the last token's own KV is computed in the last step
    assert sorted(saved) == list(range(2, chunks))
    assert [saved[c] for c in range(2, chunks)] == [
        (req.chunk_hash(c), tuple(blocks[c * CB : (c + 1) * CB])) for c in range(2, chunks)
    ]


def test_preempted_request_resumed_with_a_load_saves_no_chunk_twice() -> None:
    pool = FakePool()
    req = request("r", 5 * CT + 1)
    p = planner(pool)
    match(p, req)
    before = list(range(11))
    _, s1 = p.step([new(req, before[:5], 0, 20)])  # chunks 0 and 1
    _, s2 = p.step([running(req, before[5:6], 20, 4)])  # chunk 2
    pool.store_saves(s1 + s2)

    # preempted: its blocks are freed; resumed later from scratch (num_computed 0)
    assert match(p, req) == 3 * CT
    p.allocated(req.req_id, 3 * CT)
    after = list(range(500, 511))
    loads, s3 = p.step([(req.req_id, after, True, 3 * CT, req.prompt_tokens - 3 * CT)])

    assert per_chunk(s1 + s2) == expected(req, range(3), before)
    assert per_chunk(loads) == expected(req, range(3), after)  # into the new blocks
    assert per_chunk(s3) == expected(req, range(3, 5), after)


def test_preempted_request_recomputed_without_a_hit_saves_no_chunk_twice() -> None:
    pool = FakePool()  # saves never reach this pool: the resume misses
    req = request("r", 5 * CT + 1)
    p = planner(pool)
    match(p, req)
    before = list(range(11))
    _, s1 = p.step([new(req, before[:6], 0, 24)])  # chunks 0..2

    assert match(p, req) == 0
    p.allocated(req.req_id, 0)
    after = list(range(900, 906))
    _, s2 = p.step([(req.req_id, after, True, 0, 24)])  # recomputes chunks 0..2
    _, s3 = p.step([running(req, list(range(906, 911)), 24, 17)])

    assert per_chunk(s1) == expected(req, range(3), before)
    assert s2 == []
    all_after = after + list(range(906, 911))
    assert per_chunk(s3) == expected(req, range(3, 5), all_after)


def test_a_save_waits_for_the_chunks_blocks() -> None:
    pool = FakePool()
    req = request("r", 3 * CT + 1)
    p = planner(pool)
    match(p, req)
    blocks = list(range(7))

    _, s1 = p.step([new(req, blocks[:3], 0, 3 * CT)])  # 3 chunks computed, 3 blocks known
    _, s2 = p.step([running(req, blocks[3:], 3 * CT, 1)])

    assert per_chunk(s1) == expected(req, [0], blocks)  # chunk 1's second block is unknown
    assert per_chunk(s2) == expected(req, [1, 2], blocks)


def test_resumed_request_with_no_block_ids_keeps_none() -> None:
    pool = FakePool()
    req = request("r", 3 * CT + 1)
    p = planner(pool)
    match(p, req)
    p.step([new(req, range(3), 0, 12)])  # chunk 0 saved

    _, saves = p.step([(req.req_id, None, True, 0, 0)])  # resumed, nothing allocated yet

    assert saves == []  # no blocks: nothing can be saved, and nothing fails


def test_two_requests_in_one_step_are_planned_apart() -> None:
    pool = FakePool()
    a, b = request("a", 2 * CT + 1), request("b", 3 * CT + 1)
    pool.store(b, range(2))
    p = planner(pool)
    assert match(p, a) == 0
    assert match(p, b) == 2 * CT
    p.allocated(a.req_id, 0)
    p.allocated(b.req_id, 2 * CT)
    blocks_a, blocks_b = list(range(5)), list(range(5, 12))

    loads, saves = p.step(
        [new(a, blocks_a, 0, a.prompt_tokens), new(b, blocks_b, 2 * CT, b.prompt_tokens - 2 * CT)]
    )

    assert per_chunk(loads) == expected(b, range(2), blocks_b)
    assert sorted(per_chunk(saves)) == sorted(
        expected(a, range(2), blocks_a) + expected(b, [2], blocks_b)
    )


# -- bookkeeping ------------------------------------------------------------------------------


def test_finished_forgets_the_request() -> None:
    pool, req, p = stored("r", 3 * CT + 1, chunks=3)
    match(p, req)
    p.allocated(req.req_id, 3 * CT)
    assert p.tracked == 1

    p.finished(req.req_id)

    assert p.tracked == 0
    assert p.step([new(req, range(7), 3 * CT, 1)]) == ([], [])  # the pending load is gone
    pool.stored.clear()
    assert match(p, req) == 0  # the same id again, now a miss
    loads, _ = p.step([new(req, range(7), 0, req.prompt_tokens)])
    assert loads == []  # nothing of the finished request's plan survived


def test_finished_then_the_same_id_starts_afresh() -> None:
    pool = FakePool()
    req = request("r", 2 * CT + 1)
    p = planner(pool)
    match(p, req)
    _, first = p.step([new(req, range(5), 0, req.prompt_tokens)])
    p.finished(req.req_id)

    match(p, req)
    _, again = p.step([new(req, range(10, 15), 0, req.prompt_tokens)])

    assert per_chunk(first) == expected(req, range(2), list(range(5)))
    assert per_chunk(again) == expected(req, range(2), list(range(10, 15)))


def test_finishing_an_unknown_request_is_harmless() -> None:
    p = planner(FakePool())
    p.finished("nobody")
    assert p.tracked == 0


def test_untracked_request_ids_in_a_step_are_ignored() -> None:
    pool = FakePool()
    req = request("r", 2 * CT + 1)
    p = planner(pool)
    match(p, req)
    blocks = list(range(5))

    loads, saves = p.step(
        [
            ("ghost", list(range(40, 45)), True, 0, 17),
            new(req, blocks, 0, req.prompt_tokens),
            ("other", None, False, 17, 1),
        ]
    )

    assert loads == []
    assert per_chunk(saves) == expected(req, range(2), blocks)
    assert p.tracked == 1


# -- chunks vLLM's own prefix cache provides ---------------------------------------------------


def computed_then_cached(
    p: ChunkPlanner, pool: FakePool, prompt_tokens: int
) -> tuple[FakeRequest, FakeRequest]:
    """Request ``a`` computed and saved in full, then ``b``, the same prompt, which vLLM's own
    cache serves up to its last chunk (matched with that ``num_computed``). Returns (a, b)."""
    a = request("a", prompt_tokens, prefix="p")
    match(p, a)
    _, saves = p.step([new(a, range(len(a.hashes) + 1), 0, prompt_tokens)])
    pool.store_saves(saves)
    b = request("b", prompt_tokens, prefix="p")
    assert match(p, b, len(saves[0].hashes) * CT) == 0
    return a, b


def test_chunks_seen_in_the_pool_are_not_saved_again_from_vllms_cache() -> None:
    pool = FakePool()
    p = planner(pool)
    _, b = computed_then_cached(p, pool, 5 * CT + 1)

    loads, saves = p.step([new(b, range(50, 61), 5 * CT, 1)])

    assert (loads, saves) == ([], [])


def test_chunks_from_vllms_cache_never_seen_in_the_pool_are_saved() -> None:
    """A conversation's second turn: vLLM cached the first turn's prompt and answer; only the
    prompt was saved, so the answer's chunks are saved now, with the new ones."""
    pool = FakePool()
    p = planner(pool)
    turn1 = FakeRequest("t1", 2 * CT + 1, chained(words("q1", 2 * CB) + words("x", 1)))
    match(p, turn1)
    _, s1 = p.step([new(turn1, range(5), 0, turn1.prompt_tokens)])
    pool.store_saves(s1)
    turn2_blocks = words("q1", 2 * CB) + words("a1", 2 * CB) + words("q2", 2 * CB)
    turn2 = FakeRequest("t2", 6 * CT + 1, chained(turn2_blocks))
    assert turn2.hashes[: 2 * CB] == turn1.hashes[: 2 * CB]

    assert match(p, turn2, 4 * CT) == 0  # chunks 4 and 5 are new
    blocks = list(range(100, 113))
    _, s2 = p.step([new(turn2, blocks, 4 * CT, 2 * CT + 1)])

    assert per_chunk(s1) == expected(turn1, range(2), list(range(5)))
    assert per_chunk(s2) == expected(turn2, range(2, 6), blocks)


def test_chunks_seen_longer_ago_than_recent_s_are_saved_again() -> None:
    pool, clock = FakePool(), Clock()
    p = planner(pool, clock=clock)
    _, b = computed_then_cached(p, pool, 3 * CT + 1)
    clock.now += RECENT_S + 1

    _, saves = p.step([new(b, range(20, 27), 3 * CT, 1)])
    c = request("c", 3 * CT + 1, prefix="p")
    match(p, c, 3 * CT)
    _, again = p.step([new(c, range(30, 37), 3 * CT, 1)])

    assert per_chunk(saves) == expected(b, range(3), list(range(20, 27)))
    assert again == []  # the save just now counts as seen


def test_a_lookup_that_misses_a_seen_chunk_forgets_it() -> None:
    pool = FakePool()
    p = planner(pool)
    a, b = computed_then_cached(p, pool, 5 * CT + 1)
    pool.stored.discard(a.chunk_hash(3))  # the pool dropped chunk 3
    c = request("c", 5 * CT + 1, prefix="p")
    assert match(p, c, 2 * CT) == CT  # chunk 2 found, chunk 3 missing, chunk 4 found

    _, saves = p.step([new(b, range(50, 61), 5 * CT, 1)])

    assert per_chunk(saves) == expected(b, range(3, 5), list(range(50, 61)))


def test_after_forget_pool_the_chunks_vllm_holds_are_saved_again() -> None:
    """A pool that restarted (or could not be reached) may have lost what the planner saw in
    it: the chunks vLLM's cache serves are saved at their next hit, not left to be recomputed
    once vLLM evicts them."""
    pool = FakePool()
    p = planner(pool)
    _, b = computed_then_cached(p, pool, 5 * CT + 1)
    pool.stored.clear()  # the pool came back empty

    p.forget_pool()
    _, saves = p.step([new(b, range(50, 61), 5 * CT, 1)])

    assert per_chunk(saves) == expected(b, range(5), list(range(50, 61)))


def test_after_forget_pool_a_waiting_requests_lookup_asks_the_pool_again() -> None:
    pool = FakePool()
    other = request("other", 4 * CT + 1, prefix="p")
    pool.store(other, range(4))
    p = planner(pool)
    a = request("a", 4 * CT + 1, prefix="p")
    assert match(p, a) == 4 * CT
    pool.stored.clear()
    assert match(p, a) == 4 * CT  # still waiting: the last answer holds for REUSE_S

    p.forget_pool()

    assert match(p, a) == 0
    assert len(pool.calls) == 2


def test_chunks_found_by_a_lookup_count_as_seen() -> None:
    pool = FakePool()
    other = request("other", 4 * CT + 1, prefix="p")
    pool.store(other, range(4))  # saved by another instance
    p = planner(pool)
    a = request("a", 4 * CT + 1, prefix="p")
    assert match(p, a) == 4 * CT
    p.allocated(a.req_id, 0)  # vLLM took none of it: no load, no save planned
    b = request("b", 4 * CT + 1, prefix="p")
    match(p, b, 4 * CT)

    assert p.step([new(b, range(10, 19), 4 * CT, 1)]) == ([], [])


def test_seen_limit_keeps_the_most_recently_seen_chunks() -> None:
    pool = FakePool()
    p = planner(pool, seen_limit=3)
    a, b = computed_then_cached(p, pool, 5 * CT + 1)

    assert [a.chunk_hash(c) in p.seen for c in range(5)] == [False, False, True, True, True]
    _, saves = p.step([new(b, range(50, 61), 5 * CT, 1)])  # chunk 0 unseen: all saved again
    assert per_chunk(saves) == expected(b, range(5), list(range(50, 61)))
    assert len(p.seen) == 3
    p.seen.add([a.chunk_hash(2)])  # seen again: now the most recent, chunk 3 goes next
    p.seen.add([bytes(8)])
    assert [a.chunk_hash(c) in p.seen for c in range(2, 5)] == [True, False, True]


def test_a_resumed_request_served_by_vllms_cache_saves_only_what_it_had_not() -> None:
    pool = FakePool()
    p = planner(pool)
    req = request("r", 5 * CT + 1)
    match(p, req)
    before = list(range(11))
    _, s1 = p.step([new(req, before[:6], 0, 3 * CT)])  # chunks 0..2
    pool.store_saves(s1)

    # preempted; resumed with vLLM's cache still holding chunks 0 and 1
    assert match(p, req, 2 * CT) == CT  # chunk 2, from the pool
    p.allocated(req.req_id, CT)
    after = list(range(700, 711))
    loads, s2 = p.step([(req.req_id, after, True, 3 * CT, req.prompt_tokens - 3 * CT)])

    assert per_chunk(loads) == expected(req, [2], after)
    assert per_chunk(s2) == expected(req, range(3, 5), after)


def test_chunked_prefill_after_vllms_cache_saves_each_new_chunk_once() -> None:
    pool = FakePool()
    p = planner(pool)
    _, b = computed_then_cached(p, pool, 2 * CT + 1)  # chunks 0, 1 seen
    longer = FakeRequest("c", 5 * CT + 1, chained(words("p", 5 * CB)))
    assert longer.hashes[: 2 * CB] == b.hashes[: 2 * CB]
    assert match(p, longer, 2 * CT) == 0  # chunks 2..4 are new
    blocks = list(range(300, 311))

    _, s1 = p.step([new(longer, blocks[:6], 2 * CT, CT)])  # chunk 2
    _, s2 = p.step([running(longer, blocks[6:], 3 * CT, 2 * CT + 1)])  # chunks 3, 4

    assert per_chunk(s1) == expected(longer, [2], blocks)
    assert per_chunk(s2) == expected(longer, range(3, 5), blocks)


# -- sliding window ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "windowed", "full"),
    [
        ({0, 1, 2, 3, 4}, 5, 5),
        ({3, 4}, 5, 0),  # the window before token 40 (tokens 29..39) lies in chunks 3 and 4
        ({1, 2, 4}, 3, 0),  # chunk 3 missing: the window before token 24 is in chunks 1 and 2
        ({0, 1, 2, 4}, 3, 3),
        ({4}, 0, 0),
    ],
)
def test_a_windowed_hit_needs_only_the_chunks_of_its_window(
    stored: set[int], windowed: int, full: int
) -> None:
    """A window of 12 tokens (3 blocks): a hit ending at chunk E needs the chunks holding
    tokens E * CT - 11 on; full attention needs every chunk from the first."""
    for window, chunks in ((12, windowed), (0, full)):
        pool = FakePool()
        req = request("r", 5 * CT + 1)
        pool.store(req, stored)

        assert match(planner(pool, window=window), req) == chunks * CT, window
        assert pool.calls == [[req.chunk_hash(c) for c in range(5)]]  # one call, every chunk


def test_a_windowed_load_moves_the_windows_chunks_into_the_blocks_vllm_kept() -> None:
    """Window 12: the hit ends at token 40, whose window starts in block 7 (token 29), so
    vLLM holds its null block for blocks 0..6. The load is chunks 3 and 4 (blocks 6..9),
    block 6 skipped."""
    pool, req = FakePool(), request("r", 5 * CT + 1)
    pool.store(req, [3, 4])
    p = planner(pool, window=12)

    assert match(p, req) == 5 * CT
    table = vllm_table(req, 12, 5 * CT)
    p.allocated(req.req_id, 5 * CT, table)  # asynchronous: planned now, from vLLM's table
    (load,) = p.take_async_loads()
    assert p.take_async_loads() == []
    loads, saves = p.step([new(req, table, 5 * CT, 1)])  # run once the load is in

    assert loads == []
    assert (load.first_chunk, load.hashes) == (3, (req.chunk_hash(3), req.chunk_hash(4)))
    assert load.block_ids == (SKIP_BLOCK, 107, 108, 109)
    assert load.preceding == tuple(req.chunk_hash(c) for c in range(3))
    assert saves == []  # nothing of the prompt is left to save


def test_a_windowed_load_after_vllms_own_hit_skips_its_blocks_too() -> None:
    """vLLM's own hit is 36 tokens (blocks 0..8): the load is chunk 4 alone (the window of
    token 40 starts in block 8), its block 8 vLLM's, block 9 loaded."""
    pool, req = FakePool(), request("r", 5 * CT + 1)
    pool.store(req, [4])
    p = planner(pool, window=8)

    assert match(p, req, 9 * BS) == BS
    p.allocated(req.req_id, BS, vllm_table(req, 8, 5 * CT))
    (load,) = p.take_async_loads()
    assert (load.first_chunk, load.block_ids) == (4, (SKIP_BLOCK, 109))


def test_a_chunk_is_not_saved_once_the_window_dropped_its_first_block() -> None:
    """Window 4 (one block), a chunk of 8 tokens prefilled 7 tokens at a time: when chunk 0
    completes (step 2), vLLM has dropped its block 0 (before token 7's window), whose id may
    hold another request's KV by then. Chunk 1, computed whole in step 2, is saved, and so
    on; full attention saves every chunk."""
    for window, expect in ((4, [1, 2, 3]), (0, [0, 1, 2, 3])):
        pool, req = FakePool(), request("r", 4 * CT + 1)
        p = planner(pool, window=window)
        match(p, req)
        blocks = list(range(50, 59))

        _, s1 = p.step([new(req, blocks[:2], 0, 7)])
        _, s2 = p.step([running(req, blocks[2:4], 7, 9)])  # to 16: chunks 0 and 1
        _, s3 = p.step([running(req, blocks[4:], 16, 4 * CT + 1 - 16)])

        assert s1 == []
        assert [c for _, c, _, _ in per_chunk(s2 + s3)] == expect, window
        assert per_chunk(s2 + s3) == expected(req, expect, blocks)


def test_a_failed_asynchronous_load_is_recomputed_whole_and_saved_again() -> None:
    """vLLM computes the request from its first token after its asynchronous load failed:
    no hit for it again, and its chunks are saved as it computes them."""
    pool, req = FakePool(), request("r", 3 * CT + 1)
    pool.store(req, range(3))
    p = planner(pool, window=12)

    assert match(p, req) == 3 * CT
    table = vllm_table(req, 12, 3 * CT)
    p.allocated(req.req_id, 3 * CT, table)
    assert len(p.take_async_loads()) == 1
    p.load_failed(req.req_id)
    assert match(p, req) == 0
    p.allocated(req.req_id, 0)
    blocks = list(range(200, 207))
    loads, saves = p.step([new(req, blocks, 0, req.prompt_tokens)])

    assert loads == [] and p.take_async_loads() == []
    assert per_chunk(saves) == expected(req, range(3), blocks)


def test_full_attention_loads_are_synchronous() -> None:
    pool, req = FakePool(), request("r", 3 * CT + 1)
    pool.store(req, range(3))
    p = planner(pool)

    assert not p.async_loads
    assert match(p, req) == 3 * CT
    p.allocated(req.req_id, 3 * CT)
    assert p.take_async_loads() == []
    loads, _ = p.step([new(req, range(7), 3 * CT, 1)])
    assert len(loads) == 1


@pytest.mark.parametrize("outage", ["restarted", "unreachable"])
def test_the_scheduler_forgets_what_it_saw_in_a_pool_that_restarted_or_was_unreachable(
    vllm_python: str, pool_dir: str, outage: str
) -> None:
    """KVFlowConnectorScheduler on a real pool server (``tests.support.scheduler_outage``, in
    vLLM's interpreter): a prompt vLLM's cache holds is saved once while the pool stays up, and
    once more after a lookup met a restarted server (its ``contents_epoch`` changed) or none;
    a second failed lookup in the same outage does not make the planner forget again."""
    proc = subprocess.run(
        [vllm_python, "-m", "tests.support.scheduler_outage", f"{pool_dir}/pool.sock", outage],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])

    # A computed, A held, B computed, A held | outage | B computed, A held, A held, B computed,
    # A held
    assert steps == [4, 0, 4, 0, 4, 4, 0, 4, 0]


def test_a_plan_says_whether_its_save_may_end_in_the_next_step(
    vllm_python: str, pool_dir: str
) -> None:
    """KVFlowConnectorScheduler's plans (``tests.support.scheduler_steps``, in vLLM's
    interpreter): on ``kv_both`` with ``save_across_steps`` a step's save may end beside the
    next step, and the next plan names the requests vLLM finished or preempted since (whose
    blocks it may reuse); a request of one output token (a prefill for another instance) waits
    for its save in its step, as every step of a ``kv_producer``, of a connector without
    ``save_across_steps`` and of one with a sliding window (vLLM frees the blocks a running
    request's window left) does."""
    proc = subprocess.run(
        [vllm_python, "-m", "tests.support.scheduler_steps", f"{pool_dir}/pool.sock"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = json.loads(proc.stdout.strip().splitlines()[-1])

    # per step: save_waits, released
    assert plans["kv_both"] == [[False, []], [False, ["r0", "r1"]], [True, []]]
    assert plans["kv_producer"] == [[True, []]]
    assert plans["not_across"] == [[True, []]]
    assert plans["windowed"] == [[True, []]]
