"""``kvflow bench copy``: LocalStore.batch_copy throughput against memcpy of the same bytes.

For each block size and block-id order (in order, so each chunk's blocks coalesce into one
range; or a random permutation, one range per block) and each direction, one round times, in
turn: the memcpy reference (one ``numpy.copyto`` of the same total bytes between two other
buffers), then ``batch_copy`` in every variant: the native loop on 1 and 2 copy threads of a
kvflow ``PinnedExecutor``, unpinned and pinned (``copy_cpus``), and the Python fallback loop
(what an install without a C compiler runs: a ``LocalStore(..., native_copy=False)`` with its
own pool of the same size). Each figure is the best of N rounds; each ratio is to the memcpy of
the same rounds.

``--device cuda``: the blocks live in GPU memory and the pool is pinned; ``batch_copy`` runs as
the engine runs it for CUDA caches (``CudaDevice``: one ``cudaMemcpyAsync`` per range on
kvflow's copy stream, then a wait for the stream), and the reference is torch copying one
pinned host tensor of the same bytes to or from the GPU (``copy_(non_blocking=True)``, then a
synchronize), in the same rounds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvflow.bench.args import KiB, MiB, count, fmt_bytes, int_list, pick, size_arg, size_list
from kvflow.bench.plots import figure, format_axes, save
from kvflow.bench.report import Report
from kvflow.bench.setups import CHUNK_BLOCKS, DIRECTIONS, CopyBench, Memcpy, submit_copy
from kvflow.bench.timing import best_times, load_average, pin_cpus
from kvflow.copying.host import NATIVE, stream_min_bytes
from kvflow.cpus import cpu_list
from kvflow.devices import CudaDevice
from kvflow.pipeline.addrgen import LayerRanges
from kvflow.pipeline.executor import PinnedExecutor
from kvflow.stores.base import Direction, Store

__all__ = ["DESCRIPTION", "add_arguments", "plot", "run"]

DESCRIPTION = "LocalStore.batch_copy throughput against memcpy (numpy.copyto) of the same bytes"
BLOCKS = (4 * KiB, 16 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 1 * MiB)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bytes", type=size_arg, default=None, help="bytes per copy (256MiB; --quick 64MiB)"
    )
    parser.add_argument("--repeats", type=count, default=None, help="rounds, best of (9; quick 5)")
    parser.add_argument("--blocks", type=size_list, default=list(BLOCKS), help="block sizes")
    parser.add_argument("--threads", type=int_list, default=[1, 2], help="copy threads")
    parser.add_argument(
        "--cpus",
        type=cpu_list,
        default=None,
        help="CPUs of the pinned rows (default: the last N available, N threads)",
    )
    parser.add_argument(
        "--no-python-loop", action="store_true", help="skip the Python fallback loop rows"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the blocks live (cuda: against torch's copy of one pinned tensor)",
    )


@dataclass(frozen=True)
class Variant:
    loop: str  # "native" or "python"
    threads: int
    pinned: bool

    @property
    def label(self) -> str:
        return f"{self.loop} {self.threads}t{' pin' if self.pinned else ''}"


def _variants(threads: list[int], python: bool, device: str) -> list[Variant]:
    if device != "cpu":  # the GPU's DMA engines copy: neither CPU pinning nor a Python loop
        return [Variant("native" if NATIVE else "python", n, False) for n in threads]
    out = [Variant("native", n, p) for n in threads for p in (False, True)] if NATIVE else []
    if python or not NATIVE:
        out += [Variant("python", n, False) for n in threads]
    return out


Reference = Callable[[int, Direction], Callable[[], None]]


def _memcpy(total: int) -> Reference:
    memcpy = Memcpy(total)
    return lambda nbytes, direction: memcpy.of(nbytes)


def _torch_pinned(total: int) -> Reference:
    """torch copying one pinned host tensor to or from the GPU, then a synchronize."""
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(total, dtype=torch.uint8, device="cuda")

    def of(nbytes: int, direction: Direction) -> Callable[[], None]:
        h, g = host[:nbytes], gpu[:nbytes]
        dst, src = (h, g) if direction == Direction.TO_POOL else (g, h)

        def copy() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        return copy

    return of


class _OnDevice:
    """A pool's ``batch_copy`` as the engine's copy threads run it for CUDA caches."""

    def __init__(self, store: Store, device: CudaDevice) -> None:
        self.store, self.device = store, device

    def batch_copy(
        self, pool: np.ndarray, local: np.ndarray, sizes: np.ndarray, direction: Direction
    ) -> np.ndarray:
        with self.device.copying(direction, None):
            return self.store.batch_copy(pool, local, sizes, direction)


@dataclass
class _Run:
    total: int
    repeats: int
    variants: list[Variant]
    pins: dict[int, tuple[int, ...]]
    executors: dict[tuple[int, bool], PinnedExecutor]
    reference: Reference
    device: str

    def __post_init__(self) -> None:
        self.gpu = CudaDevice(self.device) if self.device != "cpu" else None

    def _store(self, bench: CopyBench, loop: str) -> Any:
        store = bench.store(loop)
        return store if self.gpu is None else _OnDevice(store, self.gpu)

    def gbps(
        self, bench: CopyBench, ranges: dict[str, LayerRanges], direction: Direction
    ) -> tuple[float, list[float]]:
        """GB/s of the reference and of every variant, timed in turn, best of N; each
        variant copies through the pool of its loop, with that pool's ``ranges``."""
        fns = [self.reference(bench.nbytes, direction)]
        for v in self.variants:
            executor = self.executors[v.threads, v.pinned]
            store = self._store(bench, v.loop)
            fns.append(submit_copy(store, ranges[v.loop], direction, executor))
        ref, *times = best_times(fns, self.repeats)
        return bench.nbytes / ref / 1e9, [bench.nbytes / t / 1e9 for t in times]

    def block(self, block: int) -> Iterator[tuple[float, list[Any], list[dict[str, Any]]]]:
        """Per block-id order and direction: the memcpy GB/s, a table row, the JSON rows."""
        loops = list(dict.fromkeys(v.loop for v in self.variants))
        bench = CopyBench(block, self.total // block, loops=loops, device=self.device)
        try:
            for coalesced in (True, False):
                ranges = {loop: bench.ranges(coalesced, loop=loop) for loop in loops}
                for loop, loop_ranges in ranges.items():
                    bench.verify(loop_ranges, loop, self._store(bench, loop))
                n_ranges = len(ranges[loops[0]])
                for dname, direction in DIRECTIONS:
                    ref, rates = self.gbps(bench, ranges, direction)
                    order = "in order" if coalesced else "random"
                    cells = [fmt_bytes(block), order, dname, n_ranges, f"{ref:.2f}"]
                    rows = []
                    for v, gbps in zip(self.variants, rates, strict=True):
                        cells.append(f"{gbps:.2f} {gbps / ref:4.0%}")
                        rows.append(
                            {
                                "block_bytes": block,
                                "threads": v.threads,
                                "pinned": v.pinned,
                                "coalesced": coalesced,
                                "gbps": round(gbps, 3),
                                "ratio_to_memcpy": round(gbps / ref, 4),
                                "direction": dname,
                                "loop": v.loop,
                                "cpus": list(self.pins[v.threads]) if v.pinned else None,
                                "ranges": n_ranges,
                                "bytes": bench.nbytes,
                                "memcpy_gbps": round(ref, 3),
                            }
                        )
                    yield ref, cells, rows
        finally:
            bench.close()


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    total = pick(args.bytes, args.quick, 256 * MiB, 64 * MiB)
    pins = {n: (args.cpus or pin_cpus(n)) for n in args.threads}
    executors = {
        (n, p): PinnedExecutor(n, pins[n] if p else ()) for n in args.threads for p in (False, True)
    }
    device = args.device
    variants = _variants(args.threads, not args.no_python_loop, device)
    repeats = pick(args.repeats, args.quick, 9, 5)
    reference = _memcpy(total) if device == "cpu" else _torch_pinned(total)
    runner = _Run(total, repeats, variants, pins, executors, reference, device)
    ref_name = "memcpy" if device == "cpu" else "torch pinned copy"
    if not NATIVE:
        report.note("copy: the native loop is not built; every row is the Python loop")
    loadavg = load_average()
    rows: list[dict[str, Any]] = []
    table: list[list[Any]] = []
    refs: list[float] = []
    try:
        with report.progress(len(args.blocks) * 4, "copy") as bar:
            for block in args.blocks:
                for ref, cells, block_rows in runner.block(block):
                    refs.append(ref)
                    table.append(cells)
                    rows += block_rows
                    bar.step(f"{cells[0]} {cells[1]} {cells[2]}")
    finally:
        for executor in executors.values():
            executor.shutdown(wait=True)
    report.table(
        f"copy ({device}): GB/s and share of the {ref_name} measured in the same rounds; "
        f"{fmt_bytes(total)} per copy, best of {repeats}, chunk_blocks="
        f"{CHUNK_BLOCKS}; pinned CPUs per thread count { {n: list(c) for n, c in pins.items()} }; "
        + (
            (
                f"the native loop streams ranges >= {fmt_bytes(stream_min_bytes())}"
                if stream_min_bytes()
                else "the native loop copies with memcpy (streaming slower here, turned off "
                "by KVFLOW_STREAM_COPY=0, or not built)"
            )
            if NATIVE
            else "the native loop is not built"
        ),
        [
            "block",
            "block ids",
            "direction",
            "ranges",
            ref_name,
            *(v.label for v in runner.variants),
        ],
        table,
    )
    return {
        "scenario": "copy",
        "device": device,
        "reference": "numpy.copyto" if device == "cpu" else "torch copy_ of one pinned tensor",
        "memcpy_gbps": round(max(refs), 3),
        "memcpy_gbps_min": round(min(refs), 3),
        "bytes": total,
        "repeats": repeats,
        "chunk_blocks": CHUNK_BLOCKS,
        "timer": "perf_counter (wall clock)",
        "native_loop_built": NATIVE,
        "stream_min_bytes": stream_min_bytes(),
        "pinned_cpus": {str(n): list(c) for n, c in pins.items()},
        "loadavg_start": loadavg,
        "rows": rows,
    }


def _label(row: dict[str, Any]) -> str:
    return Variant(row["loop"], row["threads"], row["pinned"]).label


def _slower(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Block sizes and, at each, the lowest ``key`` of ``rows`` (the slower direction)."""
    out: dict[int, float] = {}
    for r in rows:
        out[r["block_bytes"]] = min(out.get(r["block_bytes"], float("inf")), r[key])
    return sorted(out), [out[b] for b in sorted(out)]


def plot(result: dict[str, Any], path: str) -> None:
    """GB/s against block size per variant with memcpy as the reference line (top), and the
    share of memcpy with the 85 % target (bottom); block ids in order (left) and random
    (right). Each point is the slower of the two directions."""
    rows = result["rows"]
    blocks = sorted({r["block_bytes"] for r in rows})
    labels = list(dict.fromkeys(_label(r) for r in rows))
    fig, axes = figure(2, 2, figsize=(12, 7.5), sharex=True, sharey="row", squeeze=False)
    for col, coalesced in enumerate((True, False)):
        top, bottom = axes[0][col], axes[1][col]
        mine = [r for r in rows if r["coalesced"] == coalesced]
        top.plot(*_slower(mine, "memcpy_gbps"), "k--", lw=2, label="memcpy")
        for label in labels:
            variant = [r for r in mine if _label(r) == label]
            style = "-o" if label.startswith("native") else ":s"
            (line,) = top.plot(*_slower(variant, "gbps"), style, label=label)
            bottom.plot(*_slower(variant, "ratio_to_memcpy"), style, color=line.get_color())
        bottom.axhline(1.0, color="k", ls="--", lw=1)
        bottom.axhline(0.85, color="tab:red", ls=":", lw=1.5, label="85 % target")
        top.set_title(f"block ids {'in order (coalesced)' if coalesced else 'random'}")
        ticks = [fmt_bytes(b) for b in blocks]
        format_axes((top, bottom), None, blocks, ticks, base=2, ylog=False)
        bottom.set_xlabel("block size")
    axes[0][0].set_ylabel("GB/s (slower direction)")
    axes[1][0].set_ylabel("share of memcpy")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle(
        f"LocalStore.batch_copy vs memcpy (numpy.copyto): {fmt_bytes(result['bytes'])} per "
        f"copy, best of {result['repeats']}"
    )
    save(fig, path)
