"""KVFlowConnector with speculative decoding in real vLLM.

n-gram speculation drafts from the token history: the KV cache holds the target model's layers
only, and drafting does not change a prompt's KV, so the connector runs with it. What must stay
right is the scheduler's view: decode steps schedule the drafted tokens too (and roll back the
rejected ones), and only prompt chunks may be planned for saving. Proposers with attention
layers of their own (EAGLE, MTP, a draft model) are refused at start, with the reason.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import numpy as np
import pytest

from tests.support.processes import REPO
from tests.support.vllm import VllmRun, cached, hit, shared_extra, tokens

NGRAM = {
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    },
    "max_num_batched_tokens": 256,  # R2's prefill spreads over steps in which R1 decodes
}


def _repeating(n: int, period: int, seed: int) -> list[int]:
    """A prompt that repeats a random stretch: n-gram lookup finds what to propose."""
    stretch = np.random.default_rng(seed).integers(3, 1024, period).tolist()
    return (stretch * (n // period + 1))[:n]


R1 = _repeating(300, 50, 11)
R2 = _repeating(700, 100, 12)
DRAFTED = "vllm:spec_decode_num_draft_tokens"


@pytest.mark.timeout(900)  # three vLLM instances
def test_ngram_speculation_cold_then_warm(vllm: VllmRun, pool_dir: str) -> None:
    """Cold and warm (a new instance: every whole prompt chunk but the last token's loads), with
    the greedy tokens of vLLM with the same speculation and no connector, and drafts proposed."""
    plain = vllm([R1, R2], llm=NGRAM, max_tokens=24, counters=True)
    assert plain["counters"][DRAFTED] > 0
    extra = shared_extra(pool_dir)
    cold = vllm([R1, R2], extra=extra, llm=NGRAM, max_tokens=24, counters=True)
    assert cached(cold) == [0, 0]
    assert tokens(cold) == tokens(plain)
    assert cold["counters"][DRAFTED] > 0

    warm = vllm([R1, R2], extra=extra, llm=NGRAM, max_tokens=24, counters=True)
    assert cached(warm) == [hit(R1), hit(R2)]
    assert tokens(warm) == tokens(plain)
    assert warm["counters"][DRAFTED] > 0


SCRIPT = textwrap.dedent(
    """
    import json
    from types import SimpleNamespace as NS

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvflow.errors import ConfigError
    from kvflow.integrations.vllm.support import check_supported

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache_config = NS(kv_cache_groups=[NS(kv_cache_spec=spec)], hash_block_size=None)
    out = {}
    for method in ["ngram", "suffix", "eagle", "eagle3", "mtp", "draft_model", None]:
        vllm_config = NS(
            parallel_config=NS(pipeline_parallel_size=1, decode_context_parallel_size=1),
            speculative_config=None if method is None else NS(method=method),
            kv_transfer_config=NS(kv_load_failure_policy="recompute"),
        )
        try:
            check_supported(vllm_config, kv_cache_config)
        except ConfigError as exc:
            out[str(method)] = str(exc)
        else:
            out[str(method)] = "accepted"
    print(json.dumps(out))
    """
)


def test_drafters_with_attention_layers_are_refused_at_start(vllm_python: str) -> None:
    proc = subprocess.run(
        [vllm_python, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ngram"] == out["suffix"] == out["None"] == "accepted"
    for method in ("eagle", "eagle3", "mtp", "draft_model"):
        assert out[method].startswith(f"speculative_config.method={method!r}"), out[method]
        assert "KV cache group" in out[method]
