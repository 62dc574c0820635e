"""What ``kvflow bench ttft`` reports: the summary of its runs, its tables and its plot.

The ideal pipelined TTFT ``load_0 + sum(max(load_i, compute_i))`` comes from per-layer copy
times (the store's own timings in non_layerwise runs) and per-layer compute times (hbm_hit
runs).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from kvflow.bench.model import ModelShape
from kvflow.bench.plots import figure, save
from kvflow.bench.report import Report
from kvflow.bench.ttft_runs import MODES, TtftBench

__all__ = ["plot", "summarise"]


def _median_spans(runs: list[dict[str, Any]], key: str) -> list[float]:
    """Per-layer median duration of ``key`` intervals over runs."""
    per_layer = zip(*[[b - a for a, b in r[key]] for r in runs], strict=True)
    return [statistics.median(d) for d in per_layer]


def summarise(
    args: argparse.Namespace,
    bench: TtftBench,
    shape: ModelShape,
    runs: dict[str, list[dict[str, Any]]],
    variant_runs: dict[tuple[bool, int], list[float]],
    variants: list[tuple[bool, int]],
    report: Report,
) -> dict[str, Any]:
    ttft = {m: statistics.median(r["ttft"] for r in runs[m]) for m in MODES}
    reference = runs["hbm_hit"][0]["out"]
    exact = all(torch.equal(r["out"], reference) for m in MODES[:3] for r in runs[m])
    diff = (runs["recompute"][0]["out"].float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    tolerance = 1e-3 if shape.dtype == "float32" else 5e-2
    close = diff <= tolerance * max(scale, 1.0)
    compute = _median_spans(runs["hbm_hit"], "compute")
    load = _median_spans(runs["non_layerwise"], "transfer")
    ideal = load[0] + sum(max(a, b) for a, b in zip(load, compute, strict=True))
    result: dict[str, Any] = {
        "ttft_s": ttft,
        "layerwise_over_hbm_hit": ttft["layerwise"] / ttft["hbm_hit"],
        "non_layerwise_over_layerwise": ttft["non_layerwise"] / ttft["layerwise"],
        "pipeline_efficiency": ideal / ttft["layerwise"],
        "ideal_layerwise_s": ideal,
        "per_layer": {"compute_s": compute, "load_s": load},
        "compute_over_load": sum(compute) / sum(load),
        # how much slower the layers computed while copies ran beside them (shared memory bus)
        "compute_slowdown_during_load": sum(_median_spans(runs["layerwise"], "compute"))
        / sum(compute),
        "outputs_identical": exact,
        "recompute_max_abs_diff": diff,
        "variants": [
            {"pinned": p, "prefetch_layers": k, "ttft_s": statistics.median(variant_runs[(p, k)])}
            for p, k in variants
        ],
        "timeline": {
            m: {k: runs[m][-1][k] for k in ("compute", "transfer")}
            for m in ("layerwise", "non_layerwise")
        },
        "config": {
            **shape.as_dict(),
            "prompt_tokens": bench.total,
            "prefix_tokens": bench.prefix,
            "hit_rate": bench.prefix / bench.total,
            "store": args.store,
            "device": args.device,
            "chunk_blocks": args.chunk_blocks,
            "prefetch_layers": args.prefetch,
            "repeats": args.repeats,
            "compute_threads": args.compute_threads,
            "quick": bool(args.quick),
        },
    }
    _print(result, report)
    result["exit_code"] = 0 if exact and close else 1
    return result


def _print(r: dict[str, Any], report: Report) -> None:
    t = r["ttft_s"]
    report.table(
        "TTFT per mode (median)",
        ["mode", "ttft ms", "x hbm_hit"],
        [(m, f"{t[m] * 1e3:.1f}", f"{t[m] / t['hbm_hit']:.3f}") for m in MODES],
    )
    report.table(
        "layerwise: copy-thread pinning and prefetch window",
        ["copy thread", "prefetch_layers", "ttft ms", "x hbm_hit"],
        [
            (
                "pinned" if v["pinned"] else "floating",
                v["prefetch_layers"],
                f"{v['ttft_s'] * 1e3:.1f}",
                f"{v['ttft_s'] / t['hbm_hit']:.3f}",
            )
            for v in r["variants"]
        ],
    )
    pl = r["per_layer"]
    report.line(
        f"\nper layer: compute {statistics.mean(pl['compute_s']) * 1e3:.2f} ms, load "
        f"{statistics.mean(pl['load_s']) * 1e3:.2f} ms "
        f"(compute/load {r['compute_over_load']:.2f}); "
        f"ideal layerwise {r['ideal_layerwise_s'] * 1e3:.1f} ms; compute ran "
        f"x{r['compute_slowdown_during_load']:.2f} slower beside the copies"
    )
    report.line(
        f"layerwise / hbm_hit {r['layerwise_over_hbm_hit']:.3f}   non_layerwise / layerwise "
        f"{r['non_layerwise_over_layerwise']:.3f}   pipeline efficiency "
        f"{r['pipeline_efficiency']:.3f}"
    )
    report.line(
        f"outputs: hbm_hit, layerwise and non_layerwise identical: {r['outputs_identical']}; "
        f"recompute max |diff| {r['recompute_max_abs_diff']:.2e}"
    )


def plot(result: dict[str, Any], path: str) -> None:
    """Per-layer timelines (compute vs transfer) for both load modes, and the TTFT bars."""
    fig, axes = figure(3, 1, figsize=(11, 8), gridspec_kw={"height_ratios": [1, 1, 1.2]})
    for ax, mode in zip(axes[:2], ("layerwise", "non_layerwise"), strict=True):
        lines = result["timeline"][mode]
        for row, (key, color) in enumerate((("transfer", "tab:orange"), ("compute", "tab:blue"))):
            spans = [(a * 1e3, (b - a) * 1e3) for a, b in lines[key]]
            ax.broken_barh(spans, (row * 10 + 1, 8), facecolors=color, edgecolors="white")
        ax.set_yticks([5, 15], ["transfer", "compute"])
        ax.set_title(f"{mode}: median TTFT {result['ttft_s'][mode] * 1e3:.1f} ms (last run shown)")
        ax.set_xlabel("ms since the request arrived")
    ttft = result["ttft_s"]
    axes[2].bar(
        list(ttft),
        [v * 1e3 for v in ttft.values()],
        color=["tab:green", "tab:blue", "tab:orange", "tab:red"],
    )
    axes[2].set_ylabel("TTFT ms")
    axes[2].set_yscale("log")
    for i, v in enumerate(ttft.values()):
        axes[2].text(i, v * 1e3, f"{v * 1e3:.1f}", ha="center", va="bottom")
    save(fig, path)
