"""ChunkPlanner's tails, without vLLM: a prompt's last whole blocks short of a chunk.

What is tested: the step that completes a prompt saves its tail (its blocks, then the chunk
before's last blocks), once, and where its last block is whole the tail one block shorter,
which its repeat hits; a later prompt that extends it (a conversation's next turn) hits up to
its last whole block: its lookup asks for the tails beside the chunks, in one call, and its
load carries the tail with ``SKIP_BLOCK`` past its blocks, also when vLLM's own cache holds
every whole chunk before; a tail never covers the last prompt token, is dropped when vLLM
allocates less than the hit, and is not saved again once seen in the pool; a planner that does
not save loads tails and saves none; the first chunk has no tail; no tails with a sliding
window; the pool's keys are asked once per lookup and ``asked_tokens`` counts tokens, not keys;
with four-block chunks, the longest tail found is taken and a tail pads with the chunk before's
last blocks in order. And through the real ``TransferEngine``: a saved tail loads bit-exact
into the tail's block, and its padding places are left untouched.

The pool is a python set of stored keys (``tests/support/vllm_planning.py``); BS-token blocks,
CB = 2 blocks a chunk, so every tail is one block.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

import kvflow
from kvflow import SKIP_BLOCK
from kvflow.integrations.vllm.chunks import ChunkGrid
from kvflow.integrations.vllm.planner import ChunkPlanner
from tests.support.pools import dispose, make_store
from tests.support.vllm_planning import (
    BS,
    CT,
    FakePool,
    FakeRequest,
    chained,
    match,
    new,
    planner,
    request,
    running,
    words,
)

PROMPT = 2 * CT + BS + 2  # two whole chunks, one whole block of chunk 2, two tokens
BLOCKS = list(range(10, 16))  # its six blocks


def saved_first_turn(p: ChunkPlanner, pool: FakePool) -> FakeRequest:
    """Request ``a`` (PROMPT tokens) computed in one step, its saves stored in ``pool``."""
    a = request("a", PROMPT)
    assert match(p, a) == 0
    _, saves = p.step([new(a, BLOCKS, 0, PROMPT)])
    pool.store_saves(saves)
    p.finished(a.req_id)
    return a


def next_turn(tokens: int) -> FakeRequest:
    """A prompt of ``tokens`` tokens that starts with ``a``'s five whole blocks."""
    return FakeRequest("t2", tokens, chained(words("a", 5) + words("answer", tokens // BS - 5)))


def test_the_step_that_completes_a_prompt_saves_its_tail() -> None:
    pool = FakePool()
    p = planner(pool, tails=True)
    a = request("a", PROMPT)
    assert match(p, a) == 0

    _, saves = p.step([new(a, BLOCKS, 0, CT)])  # chunked prefill: the prompt is not done
    assert [t.hashes for t in saves] == [(a.chunk_hash(0),)]
    _, saves = p.step([running(a, None, CT, PROMPT - CT)])

    whole, tail = saves
    assert whole.hashes == (a.chunk_hash(1),)
    assert tail.hashes == (a.tail_hash(2, 1),)
    assert tail.first_chunk == 2
    assert tail.block_ids == (BLOCKS[4], BLOCKS[3])  # its block, then chunk 1's last
    assert tail.preceding == (a.chunk_hash(0), a.chunk_hash(1))
    a.decode(BS)  # decode completes block 5: no tail, no chunk of generated tokens
    assert p.step([running(a, [16], PROMPT, 1)]) == ([], [])


def test_a_prompt_extending_a_stored_one_hits_up_to_its_last_whole_block() -> None:
    pool = FakePool()
    p = planner(pool, tails=True)
    a = saved_first_turn(p, pool)
    t2 = next_turn(4 * CT + 1)  # eight whole blocks: a's five, three of its own

    assert match(p, t2) == 2 * CT + BS
    tails = [t2.tail_hash(c, 1) for c in range(1, 4)]  # the first chunk has none
    assert pool.calls[-1] == [t2.chunk_hash(c) for c in range(4)] + tails
    assert t2.tail_hash(2, 1) == a.tail_hash(2, 1)
    p.allocated(t2.req_id, 2 * CT + BS)
    blocks = list(range(30, 39))
    loads, saves = p.step([new(t2, blocks, 2 * CT + BS, t2.prompt_tokens - 2 * CT - BS)])

    (load,) = loads
    assert load.hashes == (a.chunk_hash(0), a.chunk_hash(1), a.tail_hash(2, 1))
    assert load.block_ids == (*blocks[:5], SKIP_BLOCK)
    assert [t.hashes for t in saves] == [(t2.chunk_hash(2), t2.chunk_hash(3))]


def test_a_tail_alone_is_a_hit_after_vllms_own_cache() -> None:
    pool = FakePool()
    p = planner(pool, tails=True)
    a = saved_first_turn(p, pool)
    t2 = next_turn(4 * CT + 1)

    assert match(p, t2, 2 * CT) == BS  # vLLM holds chunks 0 and 1
    asked = [t2.chunk_hash(2), t2.chunk_hash(3), t2.tail_hash(2, 1), t2.tail_hash(3, 1)]
    assert pool.calls[-1] == asked
    p.allocated(t2.req_id, BS)
    blocks = list(range(30, 39))
    loads, _ = p.step([new(t2, blocks, 2 * CT + BS, t2.prompt_tokens - 2 * CT - BS)])

    (load,) = loads
    assert load.hashes == (a.tail_hash(2, 1),)
    assert load.first_chunk == 2
    assert load.block_ids == (blocks[4], SKIP_BLOCK)


def test_a_prompt_ending_on_a_chunk_saves_the_tail_its_repeat_hits() -> None:
    """A prompt of whole chunks: its repeat (a decode node's prompt, a resumed request) cannot
    hit its last chunk, which holds its last token, but hits the tail one block shorter."""
    pool = FakePool()
    p = planner(pool, tails=True)
    a = request("a", 2 * CT)
    assert match(p, a) == 0
    _, saves = p.step([new(a, BLOCKS[:4], 0, 2 * CT)])
    whole, tail = saves
    assert whole.hashes == (a.chunk_hash(0), a.chunk_hash(1))
    assert tail.hashes == (a.tail_hash(1, 1),)
    assert tail.block_ids == (BLOCKS[2], BLOCKS[1])
    pool.store_saves(saves)

    again = request("a", 2 * CT)
    assert match(p, again) == CT + BS


def test_a_tail_never_covers_the_last_prompt_token() -> None:
    pool = FakePool()
    p = planner(pool, tails=True)
    saved_first_turn(p, pool)
    same_blocks = next_turn(2 * CT + BS)  # a's five blocks and nothing after them

    assert match(p, same_blocks) == 2 * CT  # the tail would reach the last token
    assert pool.calls[-1] == [same_blocks.chunk_hash(c) for c in range(2)] + [
        same_blocks.tail_hash(1, 1)
    ]


def test_the_first_chunk_has_no_tail() -> None:
    """A tail's save pads with the chunk before's blocks: a prompt within its first chunk
    stores no tail, and no lookup asks for one."""
    pool = FakePool()
    p = planner(pool, tails=True)
    short = request("s", BS + 2)  # one whole block
    assert match(p, short) == 0
    assert pool.calls == []  # nothing to ask: no whole chunk, no tail
    _, saves = p.step([new(short, BLOCKS[:2], 0, BS + 2)])
    assert saves == []


def test_vllm_allocating_less_than_the_hit_drops_the_tail() -> None:
    pool = FakePool()
    p = planner(pool, tails=True)
    a = saved_first_turn(p, pool)
    t2 = next_turn(4 * CT + 1)

    assert match(p, t2) == 2 * CT + BS
    p.allocated(t2.req_id, 2 * CT)
    blocks = list(range(30, 39))
    loads, _ = p.step([new(t2, blocks, 2 * CT, t2.prompt_tokens - 2 * CT)])
    (load,) = loads
    assert load.hashes == (a.chunk_hash(0), a.chunk_hash(1))
    assert load.block_ids == tuple(blocks[:4])


def test_a_tail_found_in_the_pool_is_not_saved_again() -> None:
    pool = FakePool()
    p = planner(pool, tails=True)
    saved_first_turn(p, pool)
    again = request("a", PROMPT)

    assert match(p, again) == 2 * CT + BS  # all but the last, partial, block
    p.allocated(again.req_id, 2 * CT + BS)
    loads, saves = p.step([new(again, BLOCKS, 2 * CT + BS, 2)])
    assert [t.hashes for t in loads] == [
        (again.chunk_hash(0), again.chunk_hash(1), again.tail_hash(2, 1))
    ]
    assert saves == []  # its tail was found by the lookup


def test_a_planner_that_does_not_save_loads_tails_and_saves_none() -> None:
    pool = FakePool()
    saved_first_turn(planner(pool, tails=True), pool)
    p = planner(pool, save=False, tails=True)
    t2 = next_turn(4 * CT + 2)

    assert match(p, t2) == 2 * CT + BS
    p.allocated(t2.req_id, 2 * CT + BS)
    loads, saves = p.step([new(t2, list(range(30, 39)), 2 * CT + BS, 2 * CT - BS + 2)])
    assert len(loads) == 1 and saves == []
    assert p.take_unsaved_chunks() == 2  # chunks 2 and 3; a tail is not a chunk


def test_no_tails_with_a_sliding_window() -> None:
    pool = FakePool()
    p = planner(pool, tails=True, window=4 * CT)
    a = request("a", PROMPT)
    assert match(p, a) == 0
    assert pool.calls == [[a.chunk_hash(c) for c in range(2)]]
    _, saves = p.step([new(a, BLOCKS, 0, PROMPT)])
    assert [t.hashes for t in saves] == [(a.chunk_hash(0), a.chunk_hash(1))]


def test_asked_tokens_counts_the_tokens_asked_not_the_keys() -> None:
    pool = FakePool()
    p = planner(pool, tails=True)
    saved_first_turn(p, pool)
    before = p.asked_tokens
    t2 = next_turn(4 * CT + 1)

    match(p, t2, CT)
    assert len(pool.calls[-1]) == 3 + 3  # chunks 1-3 and their tails
    assert p.asked_tokens - before == 8 * BS - CT  # from chunk 1 to the last whole block


def test_four_block_chunks_take_the_longest_tail_and_pad_in_order() -> None:
    grid = ChunkGrid(BS, 4)
    tails = grid.tails(first=0, most=11, held=5)  # vLLM holds 5 blocks; a hit ends by block 11
    assert tails == [(1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]  # chunk 0 none; (1, 1) held
    found = np.array([True, False, True, True, False])
    assert grid.longest_tails(tails, found, first=0, end=2).tolist() == [0, 2, 2]
    ids = list(range(20, 32))
    assert grid.tail_block_ids(ids, chunk=2, blocks=1) == (28, 25, 26, 27)
    assert grid.tail_block_ids(ids, chunk=1, blocks=3) == (24, 25, 26, 23)


def test_a_saved_tail_loads_into_its_block_and_leaves_its_padding_alone() -> None:
    """The planner's tail save and load through the real engine and store: the tail's block
    arrives bit-exact, the load's SKIP_BLOCK place is not written."""
    pool = FakePool()
    p = planner(pool, tails=True)
    a = request("a", PROMPT)
    match(p, a)
    _, saves = p.step([new(a, BLOCKS, 0, PROMPT)])
    pool.store_saves(saves)
    t2 = next_turn(4 * CT + 1)
    assert match(p, t2) == 2 * CT + BS
    p.allocated(t2.req_id, 2 * CT + BS)
    targets = list(range(30, 39))
    (load,), _ = p.step([new(t2, targets, 2 * CT + BS, 13)])

    gen = torch.Generator().manual_seed(3)
    src = [torch.randint(0, 255, (2, 40, 64), generator=gen, dtype=torch.uint8) for _ in range(3)]
    dst = [torch.zeros_like(t) for t in src]
    layout = kvflow.KVLayout.from_tensors([(t[0], t[1]) for t in src], block_size=BS)
    dst_layout = kvflow.KVLayout.from_tensors([(t[0], t[1]) for t in dst], block_size=BS)

    async def main() -> None:
        store = make_store("local", "16MiB")
        cfg = kvflow.EngineConfig(model="tails", chunk_blocks=2)
        async with (
            kvflow.TransferEngine(layout, store, cfg) as saver,
            kvflow.TransferEngine(dst_layout, store, cfg) as loader,
        ):
            batch = [(kvflow.ChunkHashes(t.hashes, t.preceding), t.block_ids) for t in saves]
            async with await saver.start_save(batch) as save:
                for layer in range(3):
                    await save.layer_written(layer)
                assert (await save.wait()).ok
            batch = [(kvflow.ChunkHashes(load.hashes, load.preceding), load.block_ids)]
            async with await loader.start_load(batch) as handle:
                result = await handle.wait()
            assert result.ok, result
            assert sorted(result.requests[0].ok_block_ids.tolist()) == targets[:5]
        dispose(store)

    asyncio.run(main())
    for s, d in zip(src, dst, strict=True):
        for i in range(5):  # a's five whole blocks, the tail's last, into t2's first five
            assert torch.equal(d[:, targets[i]], s[:, BLOCKS[i]])
        untouched = [b for b in range(40) if b not in targets[:5]]
        assert not d[:, untouched].any()  # the SKIP_BLOCK place among them
    assert np.asarray(load.block_ids)[-1] == SKIP_BLOCK
