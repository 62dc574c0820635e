"""``kvflow bench ttft``: time to first token on a prefix hit, four ways, in one run.

* ``hbm_hit``: the prefix KV is already in the device cache; only the new tokens are computed.
* ``layerwise``: the prefix KV is loaded from the pool through kvflow, layer i+1 copying while
  layer i computes (``wait_layer`` before each layer).
* ``non_layerwise``: the same load, every layer first, then the compute.
* ``recompute``: no hit; the whole prompt is computed.

The three modes that compute only the new tokens must give the same output bit for bit (the
loaded bytes are the computed bytes); recompute must agree within float tolerance. The ideal
pipelined TTFT ``load_0 + sum(max(load_i, compute_i))`` comes from per-layer copy times (the
store's own timings in non_layerwise runs) and per-layer compute times (hbm_hit runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvflow.bench.common import count, figure, fraction, save
from kvflow.bench.model import ModelShape, PagedModel
from kvflow.bench.report import Report
from kvflow.bench.stores import STORE_KINDS, bench_store
from kvflow.config import EngineConfig
from kvflow.errors import ConfigError, KVFlowError
from kvflow.pipeline.sync import SyncTransferEngine
from kvflow.stores.base import Direction
from kvflow.stores.local import LocalStore
from kvflow.testing import InstrumentedStore

__all__ = ["DESCRIPTION", "add_arguments", "plot", "run"]

DESCRIPTION = "TTFT on a prefix hit: HBM hit vs layerwise vs non-layerwise load vs recompute"
MODES = ("hbm_hit", "layerwise", "non_layerwise", "recompute")
# --quick: few new tokens on a long cached prefix (the next turn of a long conversation), the
# case where the load weighs most against the compute on a CPU.
QUICK = {"tokens": 2048, "new_tokens": 4, "repeats": 15}


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = ModelShape()
    p.add_argument("--layers", type=count, default=s.layers)
    p.add_argument("--hidden", type=count, default=s.hidden)
    p.add_argument("--heads", type=count, default=s.heads)
    p.add_argument("--kv-heads", type=count, default=s.kv_heads)
    p.add_argument("--head-dim", type=count, default=s.head_dim)
    p.add_argument("--mlp", type=count, default=s.mlp, help="MLP width")
    p.add_argument("--mla-dim", type=int, default=0, help="MLA latent width (0: K/V heads)")
    p.add_argument("--dtype", default=s.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=count, default=s.block_size)
    p.add_argument("--chunk-blocks", type=count, default=16)
    p.add_argument("--tokens", type=count, default=4096, help="prompt length")
    p.add_argument("--hit-rate", type=fraction, default=0.9, help="share of the prompt in the pool")
    p.add_argument(
        "--new-tokens",
        type=count,
        default=0,
        help="compute exactly this many new tokens after a chunk-aligned prefix "
        "(overrides --hit-rate)",
    )
    p.add_argument("--prefetch", type=count, default=2, help="prefetch_layers of the main run")
    p.add_argument(
        "--prefetch-variants",
        default="1,4",
        help="other prefetch windows to show "
        "(with the copy thread pinned; one more run shows it floating)",
    )
    p.add_argument("--repeats", type=count, default=3, help="runs per mode (median reported)")
    p.add_argument("--compute-threads", type=count, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", default="local", choices=STORE_KINDS, help="the pool to load from")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the model and its KV cache run (cuda: TTFTs end with a synchronize, "
        "per-layer compute is timed with CUDA events)",
    )


def _apply_quick(args: argparse.Namespace) -> None:
    defaults = argparse.Namespace()
    add_arguments(parser := argparse.ArgumentParser())
    parser.parse_args([], namespace=defaults)
    for key, value in QUICK.items():
        if getattr(args, key) == getattr(defaults, key):  # an explicit flag wins over --quick
            setattr(args, key, value)


class _Bench:
    """One model, one pool, the prompt's block tables, and the timed modes."""

    def __init__(self, args: argparse.Namespace, shape: ModelShape) -> None:
        bs, chunk_tokens = shape.block_size, args.chunk_blocks * shape.block_size
        if args.new_tokens:
            prefix = max(0, (args.tokens - args.new_tokens) // chunk_tokens * chunk_tokens)
            total = prefix + args.new_tokens
        else:
            total = args.tokens
            prefix = int(args.tokens * args.hit_rate) // chunk_tokens * chunk_tokens
        if prefix == 0 or prefix >= total:
            reason = f"no cacheable prefix: {prefix} tokens in whole chunks"
            raise ConfigError("tokens", total, reason)
        self.shape, self.total, self.prefix = shape, total, prefix
        n_all, n_pre = -(-total // bs), prefix // bs
        self.device = torch.device(args.device)
        self.model = PagedModel(shape, 2 * n_all, seed=args.seed, device=args.device)
        self.tokens = torch.from_numpy(
            np.random.default_rng(args.seed).integers(0, 1 << 30, total, dtype=np.int64)
        )
        # hbm_hit and recompute use blocks [0, n_all); loads bring the prefix into the fresh
        # blocks [n_all, n_all + n_pre) and compute the new tokens right after them
        self.hbm_first, self.load_first = 0, n_all
        self.hbm_blocks = torch.arange(n_all)
        self.load_blocks = torch.arange(n_all, n_all + n_pre)
        self.all_pos = torch.arange(total, device=self.device)
        self.new_pos = torch.arange(prefix, total, device=self.device)
        self.pool_bytes = shape.kv_bytes_per_token_layer * prefix * shape.layers + (64 << 20)
        self.store = InstrumentedStore(LocalStore(4096))  # replaced by run()'s pool

    def forward(
        self,
        first_block: int,
        positions: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
        spans: list[tuple[float, float]] | None = None,
    ) -> torch.Tensor:
        """Run every layer for the tokens at ``positions``; returns their final hidden states
        once computed (on a GPU: after a synchronize). ``spans``: per layer, when its compute
        ran (perf_counter seconds; on a GPU from CUDA events, placed on the same clock)."""
        clock = _GpuClock() if self.device.type == "cuda" else None
        now: Callable[[], Any] = clock.mark if clock else time.perf_counter
        marks = []
        x = self.model.embed_tokens(self.tokens[positions.cpu()])
        for i in range(self.shape.layers):
            if before_layer is not None:
                before_layer(i)
            start = now()
            x = self.model.layer(i, x, positions, first_block, self.total)
            marks.append((start, now()))
        if clock is not None:
            torch.cuda.synchronize()
            marks = [(clock.time(a), clock.time(b)) for a, b in marks]
        if spans is not None:
            spans.extend(marks)
        return x

    def clear_load_blocks(self) -> None:
        """Zero the blocks a load fills, so a load that fails cannot pass for one that worked
        (an index assignment writes in place; ``cache[ids].zero_()`` would zero a copy)."""
        for cache in self.model.caches:
            if self.shape.mla_dim:
                cache[self.load_blocks] = 0
            else:
                cache[:, self.load_blocks] = 0

    def engine(self, prefetch: int, copy_cpus: tuple[int, ...], chunk_blocks: int) -> Any:
        config = EngineConfig(
            model="kvflow-bench-ttft",
            chunk_blocks=chunk_blocks,
            prefetch_layers=prefetch,
            copy_cpus=copy_cpus,
        )
        return SyncTransferEngine(self.model.layout(), self.store, config)

    def hbm_run(self) -> dict[str, Any]:
        """One timed TTFT with the prefix KV already in the device cache."""
        spans: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        out = self.forward(self.hbm_first, self.new_pos, spans=spans)
        ttft = time.perf_counter() - t0
        return {"ttft": ttft, "out": out, "compute": [(a - t0, b - t0) for a, b in spans]}

    def load_run(self, engine: Any, layerwise: bool) -> dict[str, Any]:
        """One timed TTFT through the pool; returns the output and the timeline."""
        self.clear_load_blocks()
        self.store.reset()
        spans: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        hit = engine.lookup(self.tokens)
        handle = engine.start_load(
            [(self.tokens[:hit], self.load_blocks[: hit // self.shape.block_size])]
        )
        if layerwise:
            out = self.forward(self.load_first, self.new_pos, handle.wait_layer, spans)
            result = handle.wait()
        else:
            for i in range(self.shape.layers):
                handle.wait_layer(i)
            result = handle.wait()
            out = self.forward(self.load_first, self.new_pos, spans=spans)
        ttft = time.perf_counter() - t0
        if hit != self.prefix or not result.ok:
            raise KVFlowError(f"the load failed: hit {hit} of {self.prefix} tokens, {result}")
        copies = [c for c in self.store.copies if c.direction == Direction.FROM_POOL]
        return {
            "ttft": ttft,
            "out": out,
            "compute": [(a - t0, b - t0) for a, b in spans],
            "transfer": [(c.start - t0, c.end - t0) for c in copies],
        }


class _GpuClock:
    """CUDA events on the current stream, read back as perf_counter times: ``mark()`` records
    one, ``time(event)`` (after a synchronize) is when the GPU reached it."""

    def __init__(self) -> None:
        self._origin = self.mark()  # the GPU is idle here: it reaches this event at once
        self._host = time.perf_counter()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def time(self, event: Any) -> float:
        return self._host + float(self._origin.elapsed_time(event)) / 1e3


@contextmanager
def _pinned(cpus: set[int] | None, threads: int) -> Iterator[None]:
    """Pin the calling (compute) thread and set torch's thread count; restore both after."""
    old_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    if cpus and old_cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        if old_cpus is not None:
            os.sched_setaffinity(0, old_cpus)


def _median_spans(runs: list[dict[str, Any]], key: str) -> list[float]:
    """Per-layer median duration of ``key`` intervals over runs."""
    per_layer = zip(*[[b - a for a, b in r[key]] for r in runs], strict=True)
    return [statistics.median(d) for d in per_layer]


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    if args.quick:
        _apply_quick(args)
    shape = ModelShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        mlp=args.mlp,
        mla_dim=args.mla_dim,
        dtype=args.dtype,
        block_size=args.block_size,
    )
    bench = _Bench(args, shape)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    copy_cpu = cpus[-1] if len(cpus) > 1 else None
    compute_cpus = set(cpus[:-1]) if copy_cpu is not None else None
    prefetches = [args.prefetch] + [int(v) for v in args.prefetch_variants.split(",") if v]
    variants = [(True, p) for p in dict.fromkeys(prefetches)] + [(False, args.prefetch)]
    if copy_cpu is None:
        variants = [(False, p) for p in dict.fromkeys(prefetches)]
    report.note(
        f"ttft: {shape.layers} layers, prompt {bench.total} tokens, {bench.prefix} in the pool "
        f"({bench.prefix / bench.total:.1%}), {bench.total - bench.prefix} computed; "
        f"KV {shape.kv_bytes_per_token_layer * bench.prefix / 2**20:.1f} MiB per layer"
    )
    with bench_store(args.store, bench.pool_bytes) as pool:
        bench.store = InstrumentedStore(pool, record_copies=True)
        return _measure(args, report, bench, shape, copy_cpu, compute_cpus, variants)


def _measure(
    args: argparse.Namespace,
    report: Report,
    bench: _Bench,
    shape: ModelShape,
    copy_cpu: int | None,
    compute_cpus: set[int] | None,
    variants: list[tuple[bool, int]],
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    variant_runs: dict[tuple[bool, int], list[float]] = {}
    n_steps = 1 + args.repeats
    with report.progress(n_steps, "ttft") as bar:
        with _pinned(compute_cpus, args.compute_threads):
            t0 = time.perf_counter()
            full = bench.forward(bench.hbm_first, bench.all_pos)  # also fills the prefix KV
            runs["recompute"].append(
                {"ttft": time.perf_counter() - t0, "out": full[bench.prefix :]}
            )
            bar.step("recompute")
        saver = bench.engine(args.prefetch, (), args.chunk_blocks)
        saved = saver.save(
            bench.tokens[: bench.prefix], bench.hbm_blocks[: bench.prefix // shape.block_size]
        )
        saver.close()
        if not saved.ok:
            raise KVFlowError(f"saving the prefix failed: {saved}")
        engines = {
            v: bench.engine(
                v[1], (copy_cpu,) if v[0] and copy_cpu is not None else (), args.chunk_blocks
            )
            for v in variants
        }
        try:  # rounds interleave the modes, so a slow spell of the machine hits them all
            for rep in range(args.repeats):
                with _pinned(compute_cpus, args.compute_threads):
                    runs["hbm_hit"].append(bench.hbm_run())
                for (pinned, prefetch), engine in engines.items():
                    with _pinned(compute_cpus if pinned else None, args.compute_threads):
                        r = bench.load_run(engine, layerwise=True)
                        variant_runs.setdefault((pinned, prefetch), []).append(r["ttft"])
                        if (pinned, prefetch) == variants[0]:
                            runs["layerwise"].append(r)
                            runs["non_layerwise"].append(bench.load_run(engine, layerwise=False))
                bar.step(f"round {rep + 1}")
        finally:
            for engine in engines.values():
                engine.close()
    return _summarise(args, bench, shape, runs, variant_runs, variants, report)


def _summarise(
    args: argparse.Namespace,
    bench: _Bench,
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
