"""A random Llama and a word-level tokenizer, built offline: to try the connector, test it and
benchmark it on a machine with no model downloads.

``python -m kvflow.integrations.vllm.random_model DIR [--layers 8 --hidden 1024 ...]`` writes
safetensors weights, config.json and tokenizer.json to DIR. The weights are random: what matters
to a KV connector is real (layers, KV heads, head size, dtype, so the bytes per token); vLLM's
CPU attention needs head_size (hidden / heads) in {32, 64, 80, 96, 112, 128, ...}. Needs
``transformers`` and ``tokenizers`` (both come with vLLM).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 1024


def build(directory: str, *, layers: int = 4, hidden: int = 256, heads: int = 4,
          kv_heads: int = 2, dtype: str = "float32", seed: int = 0) -> Path:  # fmt: skip
    """Write the model and tokenizer into ``directory`` (once: an existing build is reused)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out  # built before (the directory names the shape: one build per shape)
    out.mkdir(parents=True, exist_ok=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    torch.manual_seed(seed)
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
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvflow-test-model.json").write_text(json.dumps({"layers": layers, "dtype": dtype}))
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(build(args.directory, layers=args.layers, hidden=args.hidden, heads=args.heads,
                kv_heads=args.kv_heads, dtype=args.dtype))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
