"""What the connector refuses at start, checked against vLLM's real KV cache spec classes.

Runs ``check_supported`` in the vLLM interpreter (``$KVFLOW_VLLM_PYTHON``) on configurations
built from vLLM's own ``FullAttentionSpec``, ``MLAAttentionSpec``, ``SlidingWindowSpec`` and
``ChunkedLocalAttentionSpec``: the attention kinds whose block tables hold vLLM's null block are
refused with a ConfigError naming the spec; full attention (also carrying a sliding window, the
form vLLM gives mixed models with its hybrid manager off) and MLA are accepted.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

from tests.pool.conftest import REPO

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
    specs = {
        "full": FullAttentionSpec(**common),
        "full_with_window": FullAttentionSpec(**common, sliding_window=128),
        "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.float32),
        "sliding_window": SlidingWindowSpec(**common, sliding_window=128),
        "chunked_local": ChunkedLocalAttentionSpec(**common, attention_chunk_size=256),
    }
    vllm_config = NS(
        parallel_config=NS(pipeline_parallel_size=1, decode_context_parallel_size=1),
        speculative_config=None,
        kv_transfer_config=NS(kv_load_failure_policy="recompute"),
    )
    out = {}
    for name, spec in specs.items():
        kv_cache_config = NS(kv_cache_groups=[NS(kv_cache_spec=spec)], hash_block_size=None)
        try:
            check_supported(vllm_config, kv_cache_config)
        except ConfigError as exc:
            out[name] = str(exc)
        else:
            out[name] = "accepted"
    print(json.dumps(out))
    """
)


def test_attention_with_null_blocks_is_refused_at_start(vllm_python: str) -> None:
    proc = subprocess.run(
        [vllm_python, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["full"] == out["full_with_window"] == out["mla"] == "accepted"
    for name, spec in [("sliding_window", "SlidingWindowSpec"), ("chunked_local", "Chunked")]:
        assert "kv_cache_spec" in out[name] and spec in out[name], out[name]
        assert "null block" in out[name]
