"""``kvflow bench disk``: the node pool's disk tier, against references measured in the same run.

* hit rate with a working set 4x the DRAM tier, on two traces (a prompt mix, and returning
  agent sessions): DRAM only, DRAM + a disk tier holding the working set, and DRAM as large
  as both (``disk_runs.hit_rates``); the load time of the hits, and the bytes that came back
  wrong (0, or the run fails its check);
* disk reads through kvflow (layer by layer, each 16 KiB range verified) against a plain
  sequential read of the same files, page cache dropped (``disk_runs.read_throughput``);
* TTFT on the synthetic model with the prefix on disk only: read layer by layer from the files
  vs promoted into DRAM first, beside the prefix in DRAM, in the device cache, and recomputed
  (``disk_ttft``); with the compute pinned beside a copy CPU of its own, and (not with
  ``--quick``) unpinned, the copy thread contending with the compute.

Figures of merit: the DRAM + disk hit rate over the big DRAM's (target >= 0.95), kvflow's read
GB/s over the plain read's (target >= 0.8), and promote-first TTFT over layerwise TTFT (the
mode kept by default is the one this ratio favours).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvflow.bench.args import count, fmt_bytes, pick, size_arg
from kvflow.bench.disk_runs import hit_rates, read_throughput
from kvflow.bench.disk_ttft import MODES, ttft_on_disk
from kvflow.bench.model import ModelShape
from kvflow.bench.report import Report

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = "the pool's disk tier: hit rate 4x past DRAM, read GB/s vs a plain read, TTFT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=count, default=None, help="requests in the mix (2000)")
    p.add_argument(
        "--chunk-bytes", type=size_arg, default=None, help="object size in the mix (64KiB)"
    )
    p.add_argument("--objects", type=count, default=None, help="objects read for GB/s (48)")
    p.add_argument("--object-bytes", type=size_arg, default=None, help="their size (4MiB)")
    p.add_argument("--layers", type=count, default=32, help="layers per object")
    p.add_argument("--repeats", type=count, default=None, help="rounds of each timing (3)")
    p.add_argument("--tokens", type=count, default=1280, help="the TTFT prompt")
    p.add_argument("--new-tokens", type=count, default=256, help="its tokens computed")
    p.add_argument("--chunk-blocks", type=count, default=16)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    repeats = pick(args.repeats, args.quick, 3, 3)
    layers = args.layers
    report.note("disk: hit rates (three pools)")
    hits = hit_rates(
        pick(args.requests, args.quick, 2000, 600),
        pick(args.chunk_bytes, args.quick, 64 << 10, 64 << 10),
        4,
        args.seed,
    )
    report.note("disk: read throughput")
    reads = read_throughput(
        pick(args.objects, args.quick, 48, 24),
        pick(args.object_bytes, args.quick, 4 << 20, 4 << 20),
        layers,
        repeats,
    )
    shape = ModelShape(layers=layers)
    ttft = []
    for pinned in (True,) if args.quick else (True, False):
        sizes = (args.tokens, args.new_tokens, args.chunk_blocks, repeats)
        ttft.append(ttft_on_disk(shape, *sizes, report, args.seed, pinned))
    result = {"quick": bool(args.quick), "hit_rates": hits, "reads": reads, "ttft": ttft}
    _print(result, report)
    for row in (r for h in hits.values() for r in h["rows"]):
        if row["wrong_bytes"] or row["failed_chunks"]:
            raise AssertionError(f"{row['pool']}: wrong bytes or failed chunks: {row}")
    if not all(t["outputs_identical"] for t in ttft):
        raise AssertionError("a load from disk gave another output than the HBM hit")
    return result


def _hit_row(r: dict[str, Any]) -> tuple[Any, ...]:
    sizes = fmt_bytes(r["dram_bytes"]), fmt_bytes(r["disk_bytes"]) if r["disk_bytes"] else "-"
    times = f"{r['load_ms_mean']:.2f}", f"{r['load_ms_p99']:.2f}"
    return (r["pool"], *sizes, f"{r['hit_rate']:.3f}", *times, r["chunks_from_disk"],
            r["wrong_bytes"])  # fmt: skip


def _print(result: dict[str, Any], report: Report) -> None:
    for trace, h in result["hit_rates"].items():
        report.table(
            f"hit rate, {trace}: {h['requests']} requests, {h['distinct_chunks']} distinct "
            f"chunks of {fmt_bytes(h['object_bytes'])} (working set "
            f"{h['working_set_over_dram']:.1f}x DRAM)",
            ["pool", "DRAM", "disk", "hit rate", "load ms mean", "p99", "from disk", "wrong"],
            [_hit_row(r) for r in h["rows"]],
        )
        report.line(f"DRAM + disk hit rate over the big DRAM's: {h['disk_over_big_dram']:.3f}")
    r = result["reads"]
    report.table(
        f"disk reads: {r['objects']} objects of {fmt_bytes(r['object_bytes'])}, "
        f"{r['layers']} layers, {r['cache']}",
        ["read", *(f"round {i + 1} GB/s" for i in range(r["repeats"]))],
        [
            ("kvflow, layer by layer", *(f"{v:.2f}" for v in r["kvflow_gbps"])),
            ("plain sequential", *(f"{v:.2f}" for v in r["plain_gbps"])),
        ],
    )
    report.line(f"kvflow over plain (medians): {r['kvflow_over_plain']:.3f}")
    for t in result["ttft"]:
        where = "compute pinned, copy thread on its own CPU" if t["pinned"] else "unpinned"
        report.table(
            f"TTFT ({where}): {t['prefix_tokens']} tokens in {t['chunks']} chunks of "
            f"{fmt_bytes(t['object_bytes'])}, {t['computed_tokens']} computed",
            ["mode", "median s", "runs"],
            [
                (m, f"{t['ttft_s'][m]:.3f}", " ".join(f"{v:.3f}" for v in t["ttft_runs_s"][m]))
                for m in MODES
            ],
        )
        report.line(
            f"promote first over layerwise: {t['promote_over_layerwise']:.3f}; layerwise from "
            f"disk over DRAM: {t['layerwise_over_dram']:.3f}; outputs identical: "
            f"{t['outputs_identical']}"
        )
