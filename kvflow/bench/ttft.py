"""``kvflow bench ttft``: time to first token on a prefix hit, four ways, in one run.

* ``hbm_hit``: the prefix KV is already in the device cache; only the new tokens are computed.
* ``layerwise``: the prefix KV is loaded from the pool through kvflow, layer i+1 copying while
  layer i computes (``wait_layer`` before each layer).
* ``non_layerwise``: the same load, every layer first, then the compute.
* ``recompute``: no hit; the whole prompt is computed.

The three modes that compute only the new tokens must give the same output bit for bit (the
loaded bytes are the computed bytes); recompute must agree within float tolerance. The runs are
``ttft_runs.py``'s, the summary, tables and plot ``ttft_report.py``'s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvflow.bench.args import count, fraction
from kvflow.bench.model import ModelShape
from kvflow.bench.report import Report
from kvflow.bench.stores import STORE_KINDS, bench_store
from kvflow.bench.timing import compute_pinned
from kvflow.bench.ttft_report import plot, summarise
from kvflow.bench.ttft_runs import MODES, TtftBench
from kvflow.cpus import affinity
from kvflow.errors import KVFlowError
from kvflow.testing import InstrumentedStore

__all__ = ["DESCRIPTION", "add_arguments", "plot", "run"]

DESCRIPTION = "TTFT on a prefix hit: HBM hit vs layerwise vs non-layerwise load vs recompute"
# --quick: few new tokens on a long cached prefix (the next turn of a long conversation), the
# case where the load weighs most against the compute on a CPU.
QUICK = {"tokens": 2048, "new_tokens": 4, "repeats": 15}
_Bench = TtftBench  # its name here before the runs moved to ttft_runs.py


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
    bench = TtftBench(args, shape)
    cpus = affinity()
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
    bench: TtftBench,
    shape: ModelShape,
    copy_cpu: int | None,
    compute_cpus: set[int] | None,
    variants: list[tuple[bool, int]],
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    variant_runs: dict[tuple[bool, int], list[float]] = {}
    n_steps = 1 + args.repeats
    with report.progress(n_steps, "ttft") as bar:
        with compute_pinned(compute_cpus, args.compute_threads):
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
                with compute_pinned(compute_cpus, args.compute_threads):
                    runs["hbm_hit"].append(bench.hbm_run())
                for (pinned, prefetch), engine in engines.items():
                    with compute_pinned(compute_cpus if pinned else None, args.compute_threads):
                        r = bench.load_run(engine, layerwise=True)
                        variant_runs.setdefault((pinned, prefetch), []).append(r["ttft"])
                        if (pinned, prefetch) == variants[0]:
                            runs["layerwise"].append(r)
                            runs["non_layerwise"].append(bench.load_run(engine, layerwise=False))
                bar.step(f"round {rep + 1}")
        finally:
            for engine in engines.values():
                engine.close()
    return summarise(args, bench, shape, runs, variant_runs, variants, report)
