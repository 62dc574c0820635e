"""``kvflow bench addrgen``: vectorised address generation against the per-block reference.

``BatchAddresses`` (built once per request batch, then ``.layer(i)`` per layer) against
``reference_layer_ranges`` (per-block Python lists), on a synthetic layout of fake addresses
(no memory behind it): 61 layers, one part of 64 KiB per block, chunk_blocks=16, for 64, 512
and 4096 blocks with block ids in order or drawn at random. The vectorised cost per layer
includes the construction, amortised over the layers. Its share of the layer's copy time uses a
``batch_copy`` of the same number of 64 KiB blocks measured in the same run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from kvflow.bench.args import count, fmt_bytes, int_list, pick, size_arg
from kvflow.bench.plots import figure, format_axes, save
from kvflow.bench.report import Report
from kvflow.bench.setups import CHUNK_BLOCKS, DIRECTIONS, MAX_TRANSFER_BYTES, CopyBench, submit_copy
from kvflow.bench.timing import best_times, load_average
from kvflow.layout import KVLayout, KVPart
from kvflow.pipeline.addrgen import BatchAddresses, reference_layer_ranges
from kvflow.pipeline.executor import PinnedExecutor

__all__ = ["DESCRIPTION", "add_arguments", "plot", "run"]

DESCRIPTION = "vectorised address generation against the per-block Python reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=count, default=61, help="layers of the model (61)")
    parser.add_argument("--blocks", type=int_list, default=[64, 512, 4096], help="blocks per batch")
    parser.add_argument(
        "--block-bytes", type=size_arg, default=64 << 10, help="bytes per block per layer"
    )
    parser.add_argument("--repeats", type=count, default=None, help="rounds, best of (7; quick 3)")


def synthetic_layout(layers: int, num_blocks: int, block_bytes: int) -> KVLayout:
    """A layout of fake addresses built from KVPart values: nothing behind them."""
    span = num_blocks * block_bytes
    return KVLayout(
        layers=tuple(
            (KVPart((1 << 40) + i * span, block_bytes, block_bytes, (block_bytes // 2,)),)
            for i in range(layers)
        ),
        num_blocks=num_blocks,
        block_size=16,
        dtype="float16",
        device="cpu",
        kind="blocks",
    )


def _check(addrs: BatchAddresses, layout: KVLayout, ids: list[int], bases: list[int]) -> None:
    """The vectorised ranges equal the reference's, first and last layer."""
    for layer in (0, layout.num_layers - 1):
        got = addrs.layer(layer)
        mine = tuple(a.tolist() for a in (got.local, got.pool, got.sizes, got.chunk))
        ref = reference_layer_ranges(layout, layer, ids, bases, CHUNK_BLOCKS, MAX_TRANSFER_BYTES)
        if mine != ref:
            raise RuntimeError(f"BatchAddresses differs from the reference at layer {layer}")


def _repeated(fn: Callable[[], Any], n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            fn()

    return run


def _layer_copy_s(blocks: int, block_bytes: int, coalesced: bool, repeats: int) -> float:
    """Best seconds to copy one layer of ``blocks`` blocks with ``batch_copy`` (either
    direction, the faster: a faster copy makes address generation a larger share)."""
    bench = CopyBench(block_bytes, blocks)
    executor = PinnedExecutor(1, ())
    try:
        ranges = bench.ranges(coalesced)
        bench.verify(ranges)
        copies = [submit_copy(bench.store(), ranges, d, executor) for _, d in DIRECTIONS]
        return min(best_times(copies, repeats)) * blocks / bench.n_blocks
    finally:
        executor.shutdown(wait=True)
        bench.close()


def measure(
    layout: KVLayout, blocks: int, coalesced: bool, repeats: int, seed: int = 1
) -> dict[str, Any]:
    """One row: the vectorised path and the reference for all layers of one batch."""
    layers = layout.num_layers
    ids = (
        np.arange(blocks, dtype=np.int64)
        if coalesced
        else np.random.default_rng(seed).choice(layout.num_blocks, blocks, replace=False)
    ).astype(np.int64)
    obj = layout.object_bytes(CHUNK_BLOCKS)
    bases = (1 << 46) + np.arange(blocks // CHUNK_BLOCKS, dtype=np.int64) * obj
    ids_list, bases_list = ids.tolist(), bases.tolist()
    addrs = BatchAddresses(layout, ids, bases, CHUNK_BLOCKS, MAX_TRANSFER_BYTES)
    _check(addrs, layout, ids_list, bases_list)

    def construct() -> BatchAddresses:
        return BatchAddresses(layout, ids, bases, CHUNK_BLOCKS, MAX_TRANSFER_BYTES)

    def vectorized() -> None:
        a = construct()
        for layer in range(layers):
            a.layer(layer)

    def layers_only() -> None:
        for layer in range(layers):
            addrs.layer(layer)

    def python() -> None:
        for layer in range(layers):
            reference_layer_ranges(
                layout, layer, ids_list, bases_list, CHUNK_BLOCKS, MAX_TRANSFER_BYTES
            )

    inner = max(1, 512 // blocks)  # several runs per timing for the small batches
    fns = [_repeated(f, inner) for f in (vectorized, layers_only, construct)] + [python]
    t_vec, t_layers, t_construct, t_py = best_times(fns, repeats)
    vec_us = t_vec / inner / layers * 1e6
    py_us = t_py / layers * 1e6
    return {
        "blocks": blocks,
        "pattern": "in order" if coalesced else "random",
        "ranges_per_layer": len(addrs.layer(0)),
        "layer_bytes": blocks * layout.layer_block_bytes(0),
        "construct_us": round(t_construct / inner * 1e6, 2),
        "layer_us": round(t_layers / inner / layers * 1e6, 3),
        "vectorized_us_per_layer": round(vec_us, 3),
        "python_us_per_layer": round(py_us, 2),
        "speedup": round(py_us / vec_us, 1),
    }


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    repeats = pick(args.repeats, args.quick, 7, 3)
    loadavg = load_average()
    rows = []
    with report.progress(len(args.blocks) * 2, "addrgen") as bar:
        for blocks in args.blocks:
            blocks -= blocks % CHUNK_BLOCKS
            layout = synthetic_layout(args.layers, 4 * blocks, args.block_bytes)
            for coalesced in (True, False):
                row = measure(layout, blocks, coalesced, repeats)
                copy_s = _layer_copy_s(blocks, args.block_bytes, coalesced, repeats)
                row["layer_copy_us"] = round(copy_s * 1e6, 1)
                row["share_of_copy_time"] = round(row["vectorized_us_per_layer"] / 1e6 / copy_s, 5)
                rows.append(row)
                bar.step(f"{blocks} blocks {row['pattern']}")
    report.table(
        f"addrgen: {args.layers} layers, {fmt_bytes(args.block_bytes)} per block per layer, "
        f"chunk_blocks={CHUNK_BLOCKS}, best of {repeats}; vectorized = construction amortised "
        f"over the layers + .layer(i); layer copy = batch_copy of the layer, same run",
        [
            "blocks",
            "block ids",
            "ranges/layer",
            "construct us",
            "layer() us",
            "vectorized us/layer",
            "python us/layer",
            "speedup",
            "layer copy us",
            "share of copy",
        ],
        [
            [
                r["blocks"],
                r["pattern"],
                r["ranges_per_layer"],
                f"{r['construct_us']:.1f}",
                f"{r['layer_us']:.2f}",
                f"{r['vectorized_us_per_layer']:.2f}",
                f"{r['python_us_per_layer']:.1f}",
                f"{r['speedup']:.0f}x",
                f"{r['layer_copy_us']:.0f}",
                f"{100 * r['share_of_copy_time']:.2f}%",
            ]
            for r in rows
        ],
    )
    return {
        "scenario": "addrgen",
        "layers": args.layers,
        "block_bytes": args.block_bytes,
        "chunk_blocks": CHUNK_BLOCKS,
        "repeats": repeats,
        "timer": "perf_counter (wall clock)",
        "loadavg_start": loadavg,
        "rows": rows,
    }


def plot(result: dict[str, Any], path: str) -> None:
    """Microseconds per layer against blocks per batch, vectorised and Python reference, block
    ids in order and random (log-log), and the speedup with the 20x target."""
    rows = result["rows"]
    fig, (cost, speedup) = figure(1, 2, figsize=(12, 4.8))
    sizes = sorted({r["blocks"] for r in rows})
    for pattern, color in (("in order", "tab:blue"), ("random", "tab:orange")):
        mine = sorted((r for r in rows if r["pattern"] == pattern), key=lambda r: r["blocks"])
        blocks = [r["blocks"] for r in mine]
        for key, style, what in (
            ("vectorized_us_per_layer", "-o", "vectorized"),
            ("python_us_per_layer", ":s", "python"),
        ):
            label = f"{what}, {pattern}"
            cost.plot(blocks, [r[key] for r in mine], style, color=color, label=label)
        speedup.plot(blocks, [r["speedup"] for r in mine], "-o", color=color, label=pattern)
    speedup.axhline(20, color="tab:red", ls=":", lw=1.5, label="20x target (512 blocks)")
    cost.set(ylabel="us per layer", title="per layer (vectorized: construction amortised)")
    speedup.set(ylabel="python / vectorized", title="speedup")
    format_axes((cost, speedup), "blocks per batch", sizes)
    cost.legend(fontsize=8)
    speedup.legend(fontsize=8)
    fig.suptitle(
        f"addrgen: {result['layers']} layers, {fmt_bytes(result['block_bytes'])} per block per "
        f"layer, chunk_blocks={result['chunk_blocks']}, best of {result['repeats']}"
    )
    save(fig, path)
