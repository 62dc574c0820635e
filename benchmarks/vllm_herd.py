"""A herd on one prefix: many concurrent requests sharing a long prefix that sits in the pool and
not on the device, kvflow beside vLLM's MooncakeStoreConnector and beside the same herd on a
device-resident prefix.

    $KVFLOW_VLLM_PYTHON benchmarks/vllm_herd.py [--rows a,b] [--size N] [--repeats N]
        [--json PATH]

Per row two ``vllm serve`` instances on one pool (``vllm_pd.start``: all servers up at once,
unbound, one compute thread each, float32, ``DEVICE_BLOCKS`` blocks of device KV, vLLM's prefix
cache on): ``seed`` computes a ``PREFIX_TOKENS``-token prefix (the connector saves it), then
``herd`` (whose device never held it) computes a prompt as long of a prefix of its own (so it
is as busy just before as ``single`` below), then gets ``--size`` requests sharing the seed's
prefix, each with its own suffix, all at once (``tests/support/herd.py``, ``/metrics``
scraped every 100 ms). Rows: ``kvflow_shared`` (KVFlowConnector on its defaults, the node's
shared pool on a private socket), ``kvflow_mooncake`` (KVFlowConnector on a
``mooncake_master``), ``mooncake_store_connector`` (vLLM's own, on a master of its own);
``single`` (no connector) computes the prefix itself and then gets the same herd: the
device-resident reference. Each
repeat a new prefix, the rows in a balanced order, every server started once.

Per row: TTFT mean and p99 over every herd request, their ratios to ``single``'s and to
``mooncake_store_connector``'s (per repeat, median over the repeats), the prefix copies the
connector gave vLLM per herd (its external hit tokens over the prefix's), the KV bytes kvflow
loaded per request, answers whose tokens differ from ``single``'s, and the scrapes' problems.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from vllm_pd import MAX_MODEL_LEN, start

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the serving helpers are shared with the tests
from tests.support.herd import PREFIX_TOKENS, SIZE, herd, seed  # noqa: E402
from tests.support.serve import chosen_rows, order, write_report  # noqa: E402

ROWS = ("kvflow_shared", "kvflow_mooncake", "mooncake_store_connector")
PEER = "mooncake_store_connector"
SHAPE = {"layers": 8, "hidden": 512}
DEVICE_BLOCKS = 128  # 4096 tokens: the prefix and a whole herd's suffixes
SETTLE_S = 1.0  # after the seed: a connector that saves after the step has done so
OWN = 10_000  # the herd server's own prefixes: prefix OWN + i before the herd on prefix i
OUT = REPO / "bench-results"


def run(servers: dict[str, Any], row: str, prefix: int, size: int) -> dict[str, Any]:
    """One herd of ``row`` on prefix ``prefix``: its summary and its answers' tokens."""
    if row == "single":
        seed(servers["single"], prefix)
        result = herd(servers["single"], prefix, size)
    else:
        seed(servers["seed"], prefix)
        # as busy as single's server just was: a prompt as long, of a prefix of its own
        seed(servers["herd"], OWN + prefix)
        time.sleep(SETTLE_S)
        result = herd(servers["herd"], prefix, size)
    return {**result.summary(), "tokens": [a.tokens for a in result.answers]}


def paired(runs: list[dict[str, Any]], ref: list[dict[str, Any]], key: str) -> float:
    """``key`` of each repeat over the reference row's in the same repeat, median."""
    return round(statistics.median(a[key] / b[key] for a, b in zip(runs, ref, strict=True)), 3)


def summarize(samples: dict[str, list[dict[str, Any]]], rows: list[str]) -> dict[str, Any]:
    """Per row over the repeats: TTFT mean/p99 and their ratios (per repeat, then the median)
    to ``single``'s and the peer's, copies, bytes per request, differing answers, scrape
    problems."""
    out: dict[str, Any] = {}
    for row in ["single", *rows]:
        runs = samples[row]
        ttfts = [t for r in runs for t in r["ttfts_ms"]]
        differing = sum(
            a != b
            for r, ref in zip(runs, samples["single"], strict=True)
            for a, b in zip(r["tokens"], ref["tokens"], strict=True)
        )
        out[row] = {
            "ttft_mean_ms": round(float(np.mean(ttfts)), 1),
            "ttft_p99_ms": round(float(np.percentile(ttfts, 99)), 1),
            "mean_vs_device": paired(runs, samples["single"], "ttft_mean_ms"),
            "p99_vs_device": paired(runs, samples["single"], "ttft_p99_ms"),
            "copies": [r["copies"] for r in runs],
            "loaded_bytes_per_request": [
                round(r["loaded_bytes"] / len(r["ttfts_ms"])) for r in runs
            ],
            "differing": differing,
            "scrape_problems": sum(
                len(r["scrape_errors"]) + len(r["scrape_problems"]) for r in runs
            ),
        }
        if PEER in samples and row != PEER:
            out[row]["mean_vs_peer"] = paired(runs, samples[PEER], "ttft_mean_ms")
            out[row]["p99_vs_peer"] = paired(runs, samples[PEER], "ttft_p99_ms")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--size", type=int, default=SIZE, help=f"requests per herd ({SIZE})")
    parser.add_argument("--repeats", type=int, default=4, help="herds per row (4)")
    parser.add_argument("--json", default=str(OUT / "vllm_herd.json"))
    args = parser.parse_args()
    rows = chosen_rows(parser, args.rows, ROWS)
    if args.repeats < 1 or not 1 <= args.size <= 64:
        parser.error(f"--repeats must be >= 1 and --size in 1..64, got {args.repeats}, {args.size}")
    from kvflow.testing.models import build

    name = f"kvflow-pd-llama-{SHAPE['layers']}x{SHAPE['hidden']}"
    model = str(build(f"{tempfile.gettempdir()}/{name}", **SHAPE))
    work = Path(tempfile.mkdtemp(prefix="kvherd-", dir="/tmp"))
    started, load_before = time.monotonic(), os.getloadavg()
    samples: dict[str, list[dict[str, Any]]] = {row: [] for row in ("single", *rows)}
    roles = {"seed": "kv_both", "herd": "kv_both"}
    with contextlib.ExitStack() as stack:
        servers = start(rows, model, args.size, work, stack, roles, DEVICE_BLOCKS)
        for i in range(args.repeats):
            for row in order(["single", *rows], i):
                samples[row].append(run(servers[row], row, i, args.size))
                print(f"repeat {i}: {row} done", file=sys.stderr)
    summary = summarize(samples, rows)
    for runs in samples.values():  # the tokens are compared; the JSON keeps the rest
        for r in runs:
            r.pop("tokens")
    document = {
        "summary": summary,
        "samples": samples,
        "shape": SHAPE,
        "prefix_tokens": PREFIX_TOKENS,
        "size": args.size,
        "device_blocks": DEVICE_BLOCKS,
        "max_model_len": MAX_MODEL_LEN,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_report(args.json, document, started=started, load_before=load_before, work=work)
    print(
        f"{'row':26s} {'mean ms':>8s} {'p99 ms':>8s} {'mean/dev':>8s} {'p99/dev':>8s} "
        f"{'mean/peer':>9s} {'p99/peer':>8s}  copies"
    )
    for row, s in summary.items():
        print(
            f"{row:26s} {s['ttft_mean_ms']:8.1f} {s['ttft_p99_ms']:8.1f} "
            f"{s['mean_vs_device']:8.3f} {s['p99_vs_device']:8.3f} "
            f"{s.get('mean_vs_peer', '-')!s:>9s} {s.get('p99_vs_peer', '-')!s:>8s}  {s['copies']}  "
            f"bytes/request {s['loaded_bytes_per_request']}  differing {s['differing']}  "
            f"scrape problems {s['scrape_problems']}"
        )
    print(f"JSON: {args.json}; logs: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
