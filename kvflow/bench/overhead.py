"""``kvflow bench overhead``: the engine's own cost per layer per step, with zero-byte copies.

A ``TransferEngine`` runs over a ``LocalStore`` wrapped so that ``batch_copy`` returns at once
without copying: what is timed is kvflow's Python alone (planning and hashing, the store's
metadata calls, address generation, the copy-thread hand-offs, the per-layer events). One step
is a batch of R requests, each a few chunks:

* load: ``start_load`` + ``wait_layer`` for every layer + ``wait``;
* save: ``start_save`` + ``layer_written`` for every layer + ``wait`` (fresh tokens each step,
  so every chunk is really written).

All requests of a step share one plan, one range template and one ``batch_copy`` per layer, so
the per-layer cost of a step should grow far slower than R. Steps for every R and both
operations are interleaved, round after round; each figure is the fastest step.

The property checked (the issue: the engine's orchestration cost per layer per step must not
grow per request per layer): per (api, op), a least-squares line of ``us_per_layer_step``
against R; its slope is what one more request adds per layer. The cost is flat per request
when that slope is under ``FLAT_SHARE`` (5 %) of the per-layer cost of a step of the fewest
requests (1 by default): a batch then scales at under 5 % of linear, where orchestrating each
request on its own per layer would scale at about 100 %.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.bench.args import count, int_list, pick
from kvflow.bench.plots import figure, format_axes, save
from kvflow.bench.report import Report
from kvflow.bench.setups import small_layout, store_for
from kvflow.bench.timing import gc_paused, load_average
from kvflow.config import EngineConfig
from kvflow.pipeline.batch import BlockRequest
from kvflow.pipeline.engine import TransferEngine
from kvflow.pipeline.sync import SyncTransferEngine
from kvflow.results import ChunkStatus
from kvflow.testing import InstrumentedStore

__all__ = ["DESCRIPTION", "FLAT_SHARE", "NullCopyStore", "add_arguments", "plot", "run"]

DESCRIPTION = "engine cost per layer per step with zero-byte copies, 1 to 256 requests a step"
CHUNK_BLOCKS = 4  # EngineConfig's default
BLOCK_BYTES = 64  # per block per layer; no byte is copied anyway
# flat per request: one more request adds under this share of a one-request step's cost per layer
FLAT_SHARE = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests", type=int_list, default=[1, 4, 16, 64, 256], help="requests per step"
    )
    parser.add_argument("--layers", type=count, default=61, help="layers of the model (61)")
    parser.add_argument("--chunks", type=count, default=2, help="chunks per request (2)")
    parser.add_argument("--steps", type=count, default=None, help="timed steps each (30; quick 10)")
    parser.add_argument(
        "--api",
        type=lambda text: [a for a in text.split(",") if a],
        default=["async", "sync"],
        help="TransferEngine (async), SyncTransferEngine (sync), or both (async,sync)",
    )


class NullCopyStore(InstrumentedStore):
    """A LocalStore (metadata and all) whose ``batch_copy`` copies nothing and succeeds."""

    def batch_copy(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)


async def _done(value: Any) -> Any:
    """``await`` for both APIs: the async engine's coroutines, the sync engine's results."""
    return await value if inspect.isawaitable(value) else value


class _Steps:
    """Steps of one engine (async, or sync and called from this thread): R requests of
    ``chunks`` chunks each, on disjoint device blocks."""

    def __init__(self, engine: TransferEngine | SyncTransferEngine, chunks: int, seed: int) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.blocks = chunks * CHUNK_BLOCKS
        self.tokens = self.blocks * engine.layout.block_size

    def batch(self, requests: int) -> list[BlockRequest]:
        """``requests`` requests with fresh token ids."""
        ids = np.arange(requests * self.blocks, dtype=np.int64).reshape(requests, self.blocks)
        toks = self.rng.integers(0, 50_000, (requests, self.tokens), dtype=np.int64)
        return [BlockRequest(t, b) for t, b in zip(toks, ids, strict=True)]

    async def step(self, op: str, batch: list[BlockRequest]) -> tuple[float, float, float]:
        """Seconds of the whole step, of its per-layer part (the layer loop), and the CPU
        seconds of the process (every thread) during the step."""
        engine = self.engine
        cpu = time.process_time()
        start = time.perf_counter()
        handle = await _done(engine.start_load(batch) if op == "load" else engine.start_save(batch))
        layer_call = handle.wait_layer if op == "load" else handle.layer_written
        layers_start = time.perf_counter()
        for layer in range(engine.layout.num_layers):
            await _done(layer_call(layer))
        layers_end = time.perf_counter()
        result = await _done(handle.wait())
        end = time.perf_counter()
        cpu = time.process_time() - cpu
        if result.count(ChunkStatus.OK) != len(batch) * self.blocks // CHUNK_BLOCKS:
            raise RuntimeError(f"overhead: a {op} step did not move every chunk: {result!r}")
        return end - start, layers_end - layers_start, cpu


Best = dict[tuple[str, int, str], list[float]]  # (api, R, op) -> the fastest step's figures


async def _measure(args: argparse.Namespace, steps: int) -> Best:
    most = max(args.requests)
    _, layout = small_layout(args.layers, most * args.chunks * CHUNK_BLOCKS, BLOCK_BYTES)
    objects = (steps + 2) * sum(args.requests) * args.chunks * len(args.api)
    store = NullCopyStore(store_for(layout, CHUNK_BLOCKS, objects))
    config = EngineConfig(model="bench-overhead", chunk_blocks=CHUNK_BLOCKS)
    engines = {
        api: (TransferEngine if api == "async" else SyncTransferEngine)(layout, store, config)
        for api in args.api
    }
    best: Best = {}
    try:
        runs = {api: _Steps(e, args.chunks, seed) for seed, (api, e) in enumerate(engines.items())}
        loads = {(api, r): run.batch(r) for api, run in runs.items() for r in args.requests}
        for (api, _), batch in loads.items():  # what the load steps find in the pool
            await runs[api].step("save", batch)
        with gc_paused():
            for step in range(steps + 1):  # the first round warms up
                for (api, r), op in itertools.product(loads, ("load", "save")):
                    batch = loads[api, r] if op == "load" else runs[api].batch(r)
                    got = await runs[api].step(op, batch)
                    if step and ((api, r, op) not in best or got[0] < best[api, r, op][0]):
                        best[api, r, op] = list(got)
    finally:
        for engine in engines.values():
            await _done(engine.close())
        store.close()
    return best


def _slope(x: Sequence[float], y: Sequence[float]) -> float:
    """The least-squares slope of ``y`` against ``x``."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    dx = xs - xs.mean()
    return float(dx @ (ys - ys.mean()) / (dx @ dx))


def growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (api, op): what one more request adds to the cost per layer of a step (the slope of
    a least-squares line over the request counts), its share of the cost per layer of a step of
    the fewest requests, and whether that share is under ``FLAT_SHARE``. With one request
    count there is no slope: the figures are None."""
    out = []
    for api, op in dict.fromkeys((r["api"], r["op"]) for r in rows):
        mine = sorted((r for r in rows if (r["api"], r["op"]) == (api, op)), key=_requests)
        requests = [r["requests"] for r in mine]
        base = mine[0]["us_per_layer_step"]
        slope = loop_slope = share = None
        if len(set(requests)) > 1:
            slope = _slope(requests, [r["us_per_layer_step"] for r in mine])
            loop_slope = _slope(requests, [r["layer_loop_us_per_layer"] for r in mine])
            share = round(slope / base, 5)
        out.append(
            {
                "api": api,
                "op": op,
                "growth_per_request_us_per_layer": _rounded(slope, 4),
                # the same for the layer loop alone, without the per-step work of start + wait
                "layer_loop_growth_per_request_us": _rounded(loop_slope, 4),
                "fewest_requests": requests[0],
                "us_per_layer_step_fewest": base,
                "growth_share": share,
                "flat": None if share is None else share < FLAT_SHARE,
            }
        )
    return out


def _requests(row: dict[str, Any]) -> int:
    return int(row["requests"])


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    steps = pick(args.steps, args.quick, 30, 10)
    loadavg = load_average()
    report.note(f"overhead: {steps + 1} rounds of {len(args.api) * len(args.requests) * 2} steps")
    best = asyncio.run(_measure(args, steps))
    layers = args.layers
    rows = []
    for (api, r, op), (total, per_layer, cpu) in best.items():
        rows.append(
            {
                "api": api,
                "requests": r,
                "op": op,
                "us_per_layer_step": round(total / layers * 1e6, 2),
                "us_per_layer_request": round(total / layers / r * 1e6, 3),
                "layer_loop_us_per_layer": round(per_layer / layers * 1e6, 2),
                "outside_layers_us": round((total - per_layer) * 1e6, 1),
                "cpu_us_per_layer_step": round(cpu / layers * 1e6, 2),
                "step_ms": round(total * 1e3, 3),
            }
        )
    rows.sort(key=lambda x: (x["api"], x["op"], x["requests"]))
    report.table(
        f"overhead: kvflow's own cost with zero-byte copies; {layers} layers, {args.chunks} "
        f"chunks of {CHUNK_BLOCKS} blocks per request, fastest of {steps} steps",
        [
            "api",
            "op",
            "requests",
            "us/layer/step",
            "us/layer/request",
            "layer loop us/layer",
            "start+wait us",
            "CPU us/layer/step",
            "step ms",
        ],
        [
            [
                x["api"],
                x["op"],
                x["requests"],
                f"{x['us_per_layer_step']:.1f}",
                f"{x['us_per_layer_request']:.2f}",
                f"{x['layer_loop_us_per_layer']:.1f}",
                f"{x['outside_layers_us']:.0f}",
                f"{x['cpu_us_per_layer_step']:.1f}",
                f"{x['step_ms']:.2f}",
            ]
            for x in rows
        ],
    )
    grown = growth(rows)
    flats = [g["flat"] for g in grown]
    flat = None if None in flats else all(flats)
    slopes = [g["growth_per_request_us_per_layer"] for g in grown]
    report.line(
        "growth per extra request, per layer (least-squares slope of us/layer/step over the "
        "requests; share of the step of the fewest requests): "
        + (
            "; ".join(
                f"{g['api']} {g['op']} {g['growth_per_request_us_per_layer']:+.3f} us "
                f"({g['growth_share']:.2%} of {g['us_per_layer_step_fewest']:.1f} us)"
                for g in grown
            )
            if flat is not None
            else "needs two request counts or more"
        )
    )
    report.line(
        f"per request per layer flat (each extra request adds < {FLAT_SHARE:.0%} of a "
        f"one-request step per layer, every api and op): "
        + {True: "yes", False: "NO", None: "not measured"}[flat]
    )
    return {
        "scenario": "overhead",
        "layers": layers,
        "chunks_per_request": args.chunks,
        "chunk_blocks": CHUNK_BLOCKS,
        "steps": steps,
        "timer": "perf_counter (wall clock); CPU = process_time, every thread",
        "loadavg_start": loadavg,
        "growth_per_request_us_per_layer": None if flat is None else max(slopes),
        "per_request_per_layer_flat": flat,
        "flat_share": FLAT_SHARE,
        "growth": grown,
        "rows": rows,
    }


def plot(result: dict[str, Any], path: str) -> None:
    """Microseconds per layer per step (left) and per layer per request (right, log-log)
    against the requests of a step, load and save, async and sync."""
    rows = result["rows"]
    requests = sorted({r["requests"] for r in rows})
    shares = {(g["api"], g["op"]): g["growth_share"] for g in result.get("growth", [])}
    fig, (step, each) = figure(1, 2, figsize=(12, 4.8))
    colors = {"load": "tab:blue", "save": "tab:orange"}
    for api, op in dict.fromkeys((r["api"], r["op"]) for r in rows):
        mine = sorted((r for r in rows if (r["api"], r["op"]) == (api, op)), key=_requests)
        x = [r["requests"] for r in mine]
        share = shares.get((api, op))
        label = f"{api} {op}" + ("" if share is None else f" ({share:+.2%} per request)")
        style = {"color": colors.get(op), "ls": "-" if api == "async" else "--", "marker": "o"}
        step.plot(x, [r["us_per_layer_step"] for r in mine], **style, label=label)
        each.plot(x, [r["us_per_layer_request"] for r in mine], **style, label=f"{api} {op}")
    step.set(ylabel="us per layer per step", title="per layer per step (flat: batched)")
    each.set(ylabel="us per layer per request", title="per layer per request")
    format_axes((step,), "requests per step", requests, ylog=False)
    format_axes((each,), "requests per step", requests)
    step.set_ylim(bottom=0)
    step.legend(fontsize=8)
    each.legend(fontsize=8)
    flat = result.get("per_request_per_layer_flat")
    fig.suptitle(
        f"overhead with zero-byte copies: {result['layers']} layers, "
        f"{result['chunks_per_request']} chunks per request, fastest of {result['steps']} steps"
        + ("" if flat is None else f"; flat per request: {'yes' if flat else 'NO'}")
    )
    save(fig, path)
