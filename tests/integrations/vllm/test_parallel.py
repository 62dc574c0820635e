"""KVFlowConnector in real vLLM with tensor parallelism 2: two worker processes, each saving and
loading its own shard under its rank, on one shared pool (a private pool server).

``VLLM_CPU_OMP_THREADS_BIND="0|1"`` gives each rank a core (without it vLLM's CPU binding asks
for one NUMA node per rank). The tiny Llama has 2 KV heads: one per rank. Prompts as in
test_vllm.py (chunks of one 32-token block): A (300 tokens), B (A's first 200, then its own),
C (150 of its own).
"""

from __future__ import annotations

import pytest

from tests.support.vllm import A, B, C, VllmRun, cached, hit, shared_extra, tokens

TP2 = {"tensor_parallel_size": 2}
ENV_TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.mark.timeout(1500)  # five vLLM instances of two workers each
def test_tensor_parallel_2(vllm: VllmRun, pool_dir: str) -> None:
    """Each phase a new vLLM instance, all with vLLM's tokens without the connector.

    1. Cold: A saved on both ranks.
    2. Rank 1 saves nothing (``debug_skip_saves`` on ``debug_rank`` 1): B loads A's shared
       chunks on both ranks; B's own chunks and C's are then on rank 0 only.
    3. B alone; every block rank 1 loads is reported failed: B's hit stops where rank 1's
       objects do (a chunk one rank lacks is no hit). vLLM joins the failed blocks of all
       ranks, so both recompute B and the tokens stay exact; no rank saves that step's chunks
       (they rest on every rank's loaded KV), so rank 1 still lacks them. C stays out of this
       phase: whether vLLM's engine process schedules it in B's step depends on when its
       request arrives, and only in B's step is its save dropped.
    4. Warm: A loads all its chunks, B only those it shares with A, C none (rank 1 lacks
       it)."""
    plain = tokens(vllm([A, B, C], llm=TP2, env=ENV_TP2))
    extra = shared_extra(pool_dir)
    cold = vllm([A], extra=extra, llm=TP2, env=ENV_TP2)
    assert cached(cold) == [0]
    assert tokens(cold) == plain[:1]

    rank1_saves_nothing = vllm(
        [B, C], extra={**extra, "debug_skip_saves": True, "debug_rank": 1}, llm=TP2, env=ENV_TP2
    )
    assert cached(rank1_saves_nothing) == [hit(B, shared=200), 0]
    assert tokens(rank1_saves_nothing) == plain[1:]

    rank1_fails = vllm(
        [B], extra={**extra, "debug_fail_loads": True, "debug_rank": 1}, llm=TP2, env=ENV_TP2
    )
    assert cached(rank1_fails) == [hit(B, shared=200)]
    assert tokens(rank1_fails) == plain[1:2]
    assert "Recovered from KV load failure" in rank1_fails["log"]

    warm = vllm([A, B, C], extra=extra, llm=TP2, env=ENV_TP2)
    assert cached(warm) == [hit(A), hit(B, shared=200), 0]
    assert tokens(warm) == plain
