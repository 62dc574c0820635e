"""A random model and a word-level tokenizer, built offline: to try the connector, test it and
benchmark it on a machine with no model downloads.

``python -m kvflow.testing.models DIR [--family llama|mistral|gemma2|deepseek]
[--layers 8 --hidden 1024 ...]`` writes safetensors weights, config.json and tokenizer.json to
DIR. The weights are random: what matters to a KV connector is real (layers, KV heads, head
size, dtype, so the bytes per token).

* ``llama`` (the default): vLLM's CPU attention needs head_size (hidden / heads) in {32, 64, 80,
  96, 112, 128, ...}.
* ``mistral``: Llama's shape with sliding-window attention (``--window`` tokens, every layer):
  vLLM keeps only the blocks a request's window still reads, and puts its null block in the
  block table for the others.
* ``gemma2``: Gemma-2-style, sliding-window (``--window``) and full-attention layers alternating,
  with Gemma's logit soft-capping; with its hybrid KV cache manager off (as with a connector
  that does not support it) vLLM gives every layer full attention's cache and keeps every block.
* ``deepseek``: a DeepSeek-V2-style model, multi-head latent attention (MLA: one latent vector
  of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, shared by every head) and
  mixture-of-experts MLPs after the first (dense) layer. vLLM runs it with its MLA backend.

Needs ``transformers`` and ``tokenizers`` (both come with vLLM).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

VOCAB = 1024
FAMILIES = ("llama", "mistral", "gemma2", "deepseek")


def build(directory: str, *, family: str = "llama", layers: int = 4, hidden: int = 256,
          heads: int = 4, kv_heads: int = 2, window: int = 128, kv_lora_rank: int = 512,
          rope_dim: int = 64, dtype: str = "float32", seed: int = 0) -> Path:  # fmt: skip
    """Write the model and tokenizer into ``directory`` (once: an existing build is reused).

    ``kv_heads`` is Llama's and Mistral's; ``window`` Mistral's sliding window in tokens;
    ``kv_lora_rank`` and ``rope_dim`` (``qk_rope_head_dim``) are DeepSeek's, whose KV per token
    and layer is their sum.
    """
    import torch

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: expected one of {FAMILIES}")
    out = Path(directory)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out  # built before (the directory names the shape: one build per shape)
    out.mkdir(parents=True, exist_ok=True)
    _tokenizer().save_pretrained(out)
    torch.manual_seed(seed)
    shape: dict[str, Any] = {"layers": layers, "hidden": hidden, "heads": heads, "dtype": dtype}
    if family == "llama":
        model = _llama(**shape, kv_heads=kv_heads)
    elif family in ("mistral", "gemma2"):
        model = _windowed(family, **shape, kv_heads=kv_heads, window=window)
    else:
        model = _deepseek(**shape, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    marker = {"family": family, "layers": layers, "dtype": dtype}
    if family in ("mistral", "gemma2"):
        marker["window"] = window
    (out / "kvflow-test-model.json").write_text(json.dumps(marker))
    return out


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _llama(*, layers: int, hidden: int, heads: int, kv_heads: int, dtype: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
    )
    return LlamaForCausalLM(config)


def _windowed(
    family: str, *, layers: int, hidden: int, heads: int, kv_heads: int, window: int, dtype: str
) -> Any:
    """Mistral's weights are drawn wider than transformers' default (std 0.1), as DeepSeek's
    below: the next token then depends on the context, so KV loaded wrong shows in the tokens.
    Gemma 2 keeps the default: with wider ones its soft-capped logits saturate, and every
    prompt gives the same token."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "sliding_window": window,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**common, initializer_range=0.1))
    gemma = Gemma2Config(**common, query_pre_attn_scalar=hidden // heads, pad_token_id=0)
    return Gemma2ForCausalLM(gemma)


def _deepseek(
    *, layers: int, hidden: int, heads: int, kv_lora_rank: int, rope_dim: int, dtype: str
) -> Any:
    """Layer 0 dense, the others MoE (4 routed experts, 2 per token, one shared). Weights drawn
    wider than transformers' default (std 0.1, not 0.02): with the default, the next token
    hardly depends on the context, so KV loaded wrong would go unseen in the tokens."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=hidden // heads,
        v_head_dim=hidden // heads,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        initializer_range=0.1,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
    )
    return DeepseekV2ForCausalLM(config)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--family", default="llama", choices=FAMILIES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="llama, mistral, gemma2")
    parser.add_argument("--window", type=int, default=128, help="mistral, gemma2: sliding window")
    parser.add_argument("--kv-lora-rank", type=int, default=512, help="deepseek")
    parser.add_argument("--rope-dim", type=int, default=64, help="deepseek: qk_rope_head_dim")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(build(args.directory, family=args.family, layers=args.layers, hidden=args.hidden,
                heads=args.heads, kv_heads=args.kv_heads, window=args.window,
                kv_lora_rank=args.kv_lora_rank,
                rope_dim=args.rope_dim, dtype=args.dtype))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
