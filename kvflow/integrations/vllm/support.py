"""What the vLLM connector handles, checked once when vLLM builds it: a configuration it cannot
serve correctly is refused at start with a ConfigError, never discovered by failing requests.

Handled: one KV cache group of full attention (``FullAttentionSpec``; also the form vLLM gives
the sliding-window layers of a model that mixes them with full ones while its hybrid KV cache
manager is off: it then keeps every block) or MLA (``MLAAttentionSpec``); tensor parallelism.
Refused, with the reason in the message:

- several KV cache groups (vLLM's hybrid KV cache manager);
- attention whose block tables hold vLLM's null block for tokens it no longer keeps
  (``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec`` and the other kinds that are not full
  attention): a chunk's blocks are then partly gone, so it can be neither saved whole nor
  loaded into its blocks;
- a hash block size other than the block size; pipeline and decode-context parallelism;
  speculative decoding.
"""

from __future__ import annotations

import logging
from typing import Any

from kvflow.errors import ConfigError

log = logging.getLogger("kvflow")


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise ConfigError for what the connector does not handle (rather than move wrong bytes);
    warn where vLLM's own setting makes a failed load fail its request."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = len(kv_cache_config.kv_cache_groups)
    if groups != 1:
        raise ConfigError("kv_cache_groups", groups, "kvflow's connector handles one group")
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ConfigError(
            "kv_cache_spec",
            type(spec).__name__,
            "kvflow's connector handles full attention and MLA; this attention's block tables "
            "hold vLLM's null block for tokens it no longer keeps, which kvflow can neither "
            "save nor load (sliding-window and chunked-local attention are not supported yet)",
        )
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or spec.block_size
    if hash_block != spec.block_size:
        raise ConfigError("hash_block_size", hash_block, f"must equal block_size={spec.block_size}")
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, name, 1) not in (None, 1):
            raise ConfigError(name, getattr(parallel, name), "not supported by kvflow's connector")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ConfigError(
            "speculative_config",
            "set",
            "speculative decoding is not supported by kvflow's connector",
        )
    policy = vllm_config.kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        log.warning(
            "kvflow: kv_load_failure_policy=%r: a chunk that fails to load fails its request; "
            "set it to 'recompute' to recompute the chunk instead",
            policy,
        )
