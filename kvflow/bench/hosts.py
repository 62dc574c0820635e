"""``kvflow bench hosts``: kvflow on one Mooncake pool across hosts (network namespaces on this
machine, ``kvflow.testing.netns``; root only), Mooncake's TCP transport between them.

* load throughput with 1, 2 and 3 hosts reading at once what one host saved: the aggregate
  GB/s, and over one reader's, every byte checked; repeats alternate the order of the counts;
* every fault of ``kvflow.bench.hostfaults`` under load: what the engine saw while it lasted,
  its slowest request, the seconds until one request, then every prompt, hit in full again, and
  the wrong chunks (0, or the run fails its check).

All hosts share this machine's CPUs: the aggregate is bounded by them, not by the links.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from kvflow.bench.args import count, pick
from kvflow.bench.cluster import Cluster
from kvflow.bench.hostfaults import FAULTS, run_fault, without_events
from kvflow.bench.hostload import OBJECT_BYTES
from kvflow.bench.report import Report
from kvflow.testing.netns import NetworkError, has_netem

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = "Mooncake across hosts (network namespaces): load GB/s with 1-3 readers, faults"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=count, default=None, help="prompts loaded (48)")
    p.add_argument("--chunks", type=count, default=16, help="chunks of 128 KiB per prompt")
    p.add_argument("--rounds", type=count, default=None, help="loads of each, per reader (3)")
    p.add_argument("--repeats", type=count, default=None, help="runs of each reader count (2)")
    p.add_argument(
        "--faults", default=",".join(FAULTS), help="which faults to run, comma-separated"
    )


def throughput(readers: int, prompts: int, rounds: int, chunks: int) -> dict[str, Any]:
    """One host saves ``prompts``; ``readers`` others load them all ``rounds`` times at once."""
    with (
        tempfile.TemporaryDirectory(prefix="kvflow-hosts-") as directory,
        Cluster(2 + readers, directory, prefix="throughput/") as cluster,
    ):
        ids = list(range(prompts))
        saver = cluster.worker(
            1, "saver", "saver", segment="256MiB", prompts=ids, chunks=chunks,
            release=cluster.path("end"),
        )  # fmt: skip
        saver.wait_ready()
        go = cluster.path("go")
        loaders = [
            cluster.worker(
                h, f"loader{h}", "loader", prompts=ids, chunks=chunks, rounds=rounds, go=go
            )
            for h in range(2, 2 + readers)
        ]
        for loader in loaders:
            loader.wait_ready()
        open(go, "w").close()
        results = [loader.result(600) for loader in loaders]
        open(cluster.path("end"), "w").close()
    moved = sum(r["bytes"] for r in results)
    seconds = max(r["seconds"] for r in results)
    return {
        "readers": readers,
        "bytes": moved,
        "seconds": round(seconds, 4),
        "gbps": round(moved / seconds / 1e9, 4),
        "wrong": sum(r["wrong"] for r in results),
        "failed": sum(r["failed"] + r["missing"] for r in results),
        "master_calls_per_batch": sorted({c for r in results for c in r["master_calls_per_batch"]}),
    }


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    prompts = pick(args.prompts, args.quick, 48, 8)
    rounds = pick(args.rounds, args.quick, 3, 1)
    repeats = pick(args.repeats, args.quick, 2, 1)
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"--faults: unknown {unknown}; known: {', '.join(FAULTS)}")

    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        order = (1, 2, 3) if r % 2 == 0 else (3, 2, 1)
        for readers in order:
            report.note(f"hosts: {readers} reader(s), repeat {r + 1}")
            runs.append(throughput(readers, prompts, rounds, args.chunks))
    rows = []
    one = [x["gbps"] for x in runs if x["readers"] == 1]
    base = sorted(one)[len(one) // 2]
    for readers in (1, 2, 3):
        got = sorted(x["gbps"] for x in runs if x["readers"] == readers)
        median = got[len(got) // 2]
        rows.append([readers, *(f"{g:.3f}" for g in got), f"{median / base:.2f}"])
    report.table(
        f"load GB/s, {prompts} prompts x {args.chunks} chunks of {OBJECT_BYTES >> 10} KiB, "
        f"{rounds} round(s), every byte checked (not timed)",
        ["readers", *(f"run {i + 1}" for i in range(repeats)), "median / 1 reader"],
        rows,
    )
    wrong = sum(x["wrong"] for x in runs)

    table, fault_runs = [], []
    for fault in faults:
        if fault == "lossy_link" and not has_netem():
            report.note("hosts: lossy_link skipped: this kernel's tc has no netem queue")
            fault_runs.append({"fault": fault, "skipped": "no netem in this kernel"})
            continue
        report.note(f"hosts: fault {fault}")
        with tempfile.TemporaryDirectory(prefix="kvflow-fault-") as directory:
            try:
                summary = without_events(run_fault(directory, fault))
            except NetworkError as exc:
                fault_runs.append({"fault": fault, "skipped": str(exc)})
                continue
        fault_runs.append(summary)
        wrong += summary["wrong_chunks"]
        during = summary["during"]
        table.append([
            fault, during["requests"], during["chunks_ok"], during["failed"],
            during["missing"] + during["not_found"], summary["slowest_step_s"],
            summary["recovered_s"], summary["all_recovered_s"], summary["wrong_chunks"],
        ])  # fmt: skip
    if table:
        report.table(
            "faults under load (during: from the fault until every prompt hit in full again)",
            ["fault", "requests", "chunks ok", "failed", "not found", "slowest s",
             "first full s", "all full s", "wrong"],
            table,
        )  # fmt: skip
    if wrong:
        raise AssertionError(f"{wrong} chunks loaded with wrong bytes")
    return {
        "prompts": prompts,
        "chunks": args.chunks,
        "rounds": rounds,
        "object_bytes": OBJECT_BYTES,
        "throughput": runs,
        "faults": fault_runs,
        "cpus": os.cpu_count(),
    }
