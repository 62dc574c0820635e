"""``kvflow bench pool``: the shared pool (``kvflow serve`` + SharedStore) against the embedded
LocalStore, in one run.

* copy throughput: the same layout, the same request, saved and loaded layer by layer through a
  TransferEngine on each pool, the rounds interleaved. ``copy GB/s`` sums the store's own
  ``batch_copy`` times (InstrumentedStore); ``request GB/s`` is the whole save or load, metadata
  round trips included. The ratio shared / local is the figure of merit (target >= 0.90).
* metadata round trips per request batch: counted at the server (its ``requests`` counter), for
  a save and for a lookup + load, at several layer counts.
* lookup of many keys in one call: the latency of ``store.lookup`` over 4096 chunk keys, all
  stored, on each pool.
* eviction under pressure: a prompt mix replayed through a pool holding a fraction of its
  chunks; the share of the used bytes a lookup reaches and the hit rate, under the pools'
  tail-first eviction and under the plain LRU before it (``kvflow.bench.eviction``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from kvflow.bench import eviction
from kvflow.bench.args import count, fmt_bytes, int_list, pick, size_arg
from kvflow.bench.plots import figure, save
from kvflow.bench.report import Report
from kvflow.bench.setups import small_layout
from kvflow.bench.stores import bench_store
from kvflow.config import EngineConfig
from kvflow.errors import KVFlowError
from kvflow.keys import KeySpace
from kvflow.layout import KVLayout
from kvflow.pipeline.engine import TransferEngine
from kvflow.pool.store import SharedStore
from kvflow.stores.base import Direction, Store
from kvflow.testing import InstrumentedStore

__all__ = ["DESCRIPTION", "add_arguments", "plot", "run"]

DESCRIPTION = "shared pool vs embedded pool: copy throughput, metadata round trips, big lookups"
KINDS = ("local", "shared")
CHUNK = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=count, default=32, help="layers of the throughput layout")
    parser.add_argument(
        "--block-bytes", type=size_arg, default=None, help="bytes per block per layer (64KiB)"
    )
    parser.add_argument("--blocks", type=count, default=None, help="blocks per request (128)")
    parser.add_argument("--repeats", type=count, default=None, help="interleaved rounds (9)")
    parser.add_argument(
        "--round-trip-layers", type=int_list, default=[8, 32, 61], help="layer counts counted"
    )
    parser.add_argument("--lookup-keys", type=count, default=4096, help="keys in one lookup")
    parser.add_argument(
        "--eviction-requests", type=count, default=None, help="requests in the eviction mix (3000)"
    )
    parser.add_argument(
        "--eviction-pool", type=count, default=None, help="chunks the eviction pool holds (96)"
    )
    parser.add_argument(
        "--eviction-checkpoints",
        type=count,
        default=None,
        help="points of the mix where reachability is read (4)",
    )


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    block_bytes = pick(args.block_bytes, args.quick, 64 << 10, 64 << 10)
    blocks = pick(args.blocks, args.quick, 256, 128)
    repeats = pick(args.repeats, args.quick, 9, 5)
    tensors, layout = small_layout(args.layers, 2 * blocks, block_bytes)
    nbytes = layout.object_bytes(CHUNK) * (blocks // CHUNK)
    evict_sizes = (
        pick(args.eviction_requests, args.quick, 3000, 800),
        pick(args.eviction_pool, args.quick, 96, 48),
        pick(args.eviction_checkpoints, args.quick, 4, 2),
    )
    eviction.check(*evict_sizes)
    report.note(
        f"pool: {args.layers} layers x {blocks} blocks x {fmt_bytes(block_bytes)} = "
        f"{fmt_bytes(nbytes)} per request, {repeats} interleaved rounds"
    )
    throughput = _throughput(layout, blocks, nbytes, repeats, report)
    round_trips = _round_trips(args.round_trip_layers, report)
    lookups = _lookups(args.lookup_keys, repeats, report)
    del tensors
    evicting = eviction.run(*evict_sizes)
    report.note("eviction mix replayed")
    result = {
        "throughput": throughput,
        "round_trips": round_trips,
        "lookup": lookups,
        "eviction": evicting,
    }
    _print(result, report)
    ok = all(v >= 0.9 for v in throughput["ratio_copy"].values())
    constant = (
        len({r["save"] for r in round_trips}) == 1 and len({r["load"] for r in round_trips}) == 1
    )
    reachable = all(
        r["reachable_min"] >= 0.99
        for r in evicting["rows"]
        if r["pattern"] in eviction.TARGET_PATTERNS and r["pool"] != "before"
    )
    result["targets"] = {
        "copy_ratio_ge_0.90": ok,
        "round_trips_constant": constant,
        "reachable_ge_0.99": reachable,
    }
    result["config"] = {
        "layers": args.layers,
        "block_bytes": block_bytes,
        "blocks": blocks,
        "chunk_blocks": CHUNK,
        "repeats": repeats,
        "quick": bool(args.quick),
    }
    return result


# -- copy throughput --------------------------------------------------------------------------


async def _one_round(
    engine: TransferEngine, store: InstrumentedStore, blocks: int, seed: int
) -> dict[str, float]:
    tokens = np.random.default_rng(seed).integers(0, 1 << 30, blocks * 16)
    out: dict[str, float] = {}
    store.reset()
    t0 = time.perf_counter()
    saved = await engine.save(tokens, np.arange(blocks))
    out["save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = await engine.load(tokens, np.arange(blocks, 2 * blocks))
    out["load_s"] = time.perf_counter() - t0
    if not (saved.ok and loaded.ok):
        raise KVFlowError(f"a benchmark transfer failed: {saved} / {loaded}")
    for name, direction in (("save", Direction.TO_POOL), ("load", Direction.FROM_POOL)):
        out[f"{name}_copy_s"] = sum(
            c.end - c.start for c in store.copies if c.direction == direction
        )
    return out


def _throughput(
    layout: KVLayout, blocks: int, nbytes: int, repeats: int, report: Report
) -> dict[str, Any]:
    capacity = nbytes * (repeats + 3) + (64 << 20)
    per_kind: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}

    async def main(stores: dict[str, InstrumentedStore]) -> None:
        config = EngineConfig(model="kvflow-bench-pool", chunk_blocks=CHUNK)
        engines = {k: TransferEngine(layout, s, config) for k, s in stores.items()}
        try:
            with report.progress(repeats + 1, "pool throughput") as bar:
                for rep in range(repeats + 1):  # round 0 warms up (first touch, connections)
                    order = list(engines.items())
                    for kind, engine in order if rep % 2 else order[::-1]:  # alternate who leads
                        r = await _one_round(engine, stores[kind], blocks, seed=rep)
                        if rep:
                            per_kind[kind].append(r)
                    bar.step(f"round {rep}")
        finally:
            for engine in engines.values():
                await engine.close()

    with bench_store("local", capacity) as local, bench_store("shared", capacity) as shared:
        stores = {
            "local": InstrumentedStore(local, record_copies=True),
            "shared": InstrumentedStore(shared, record_copies=True),
        }
        asyncio.run(main(stores))
    gbps: dict[str, dict[str, float]] = {}
    for kind, rounds in per_kind.items():
        gbps[kind] = {
            key: nbytes / statistics.median(r[f"{key}_s"] for r in rounds) / 1e9
            for key in ("save_copy", "load_copy", "save", "load")
        }
    ratio_copy = {
        k: gbps["shared"][f"{k}_copy"] / gbps["local"][f"{k}_copy"] for k in ("save", "load")
    }
    ratio_request = {k: gbps["shared"][k] / gbps["local"][k] for k in ("save", "load")}
    return {"bytes": nbytes, "gbps": gbps, "ratio_copy": ratio_copy, "ratio_request": ratio_request}


# -- metadata round trips ---------------------------------------------------------------------


def _round_trips(layer_counts: list[int], report: Report) -> list[dict[str, int]]:
    rows = []
    for layers in layer_counts:
        tensors, layout = small_layout(layers, 64, 256)
        with bench_store("shared", 64 << 20) as store:
            assert isinstance(store, SharedStore)
            rows.append({"layers": layers, **asyncio.run(_count_requests(layout, store))})
        del tensors
    report.note(f"round trips counted at {len(rows)} layer counts")
    return rows


async def _count_requests(layout: KVLayout, store: SharedStore) -> dict[str, int]:
    def requests() -> int:
        return store.server_stats()["requests"] - 1  # less the stats request itself

    config = EngineConfig(model="kvflow-bench-pool", chunk_blocks=CHUNK)
    tokens = np.random.default_rng(0).integers(0, 1 << 30, 32 * 16)
    async with TransferEngine(layout, store, config) as engine:
        base = requests()
        saved = await engine.save(tokens, np.arange(32))
        after_save = requests()
        hit = await engine.lookup(tokens)
        loaded = await engine.load(tokens[:hit], np.arange(32, 64))
        after_load = requests()
    if not (saved.ok and loaded.ok and hit == len(tokens)):
        raise KVFlowError("the round-trip count's transfers failed")
    return {"save": after_save - base - 1, "load": after_load - after_save - 1}


# -- big lookups ------------------------------------------------------------------------------


def _lookups(n_keys: int, repeats: int, report: Report) -> dict[str, Any]:
    space = KeySpace.for_layout(
        model="kvflow-bench-pool",
        layout_fingerprint="0" * 16,
        chunk_blocks=CHUNK,
        num_layers=32,
        rank=0,
    )
    keys = space.keys([i.to_bytes(16, "big") for i in range(n_keys)])
    out: dict[str, Any] = {"keys": n_keys}
    for kind in KINDS:
        with bench_store(kind, n_keys * 4096 + (16 << 20)) as store:
            _fill(store, keys)
            times = []
            for _ in range(max(repeats, 5) * 4):
                t0 = time.perf_counter()
                found = store.lookup(keys)
                times.append(time.perf_counter() - t0)
            if not found.all():
                raise KVFlowError(f"{kind}: lookup of stored keys missed")
        out[kind] = {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}
    report.note(f"lookup of {n_keys} keys measured")
    return out


def _fill(store: Store, keys: list[str]) -> None:
    session = store.open_write(keys, 4096)
    store.finish_write(session, np.ones(len(keys), dtype=bool))


def _print(result: dict[str, Any], report: Report) -> None:
    t = result["throughput"]
    rows = []
    for key, label in (("save", "save"), ("load", "load")):
        rows.append(
            (
                label,
                f"{t['gbps']['local'][key + '_copy']:.2f}",
                f"{t['gbps']['shared'][key + '_copy']:.2f}",
                f"{t['ratio_copy'][key]:.3f}",
                f"{t['gbps']['local'][key]:.2f}",
                f"{t['gbps']['shared'][key]:.2f}",
                f"{t['ratio_request'][key]:.3f}",
            )
        )
    report.table(
        f"throughput, {fmt_bytes(t['bytes'])} per request (GB/s, median)",
        [
            "",
            "copy local",
            "copy shared",
            "shared/local",
            "request local",
            "request shared",
            "shared/local",
        ],
        rows,
    )
    report.table(
        "metadata round trips to the server per request batch",
        ["layers", "save", "lookup + load"],
        [(r["layers"], r["save"], r["load"]) for r in result["round_trips"]],
    )
    lk = result["lookup"]
    report.table(
        f"lookup of {lk['keys']} keys in one call (ms)",
        ["pool", "median", "min"],
        [(k, f"{lk[k]['median_ms']:.2f}", f"{lk[k]['min_ms']:.2f}") for k in KINDS],
    )
    ev = result["eviction"]
    by = {(r["pattern"], r["pool"]): r for r in ev["rows"]}
    report.table(
        f"eviction: {ev['requests']} requests ({ev['distinct_chunks']} distinct chunks) through "
        f"a pool of {ev['pool_chunks']} chunks; reachable: share of the used bytes a lookup "
        f"reaches (mean of {ev['checkpoints']} points, worst in brackets)",
        ["saves", "policy", "pool", "reachable", "hit rate"],
        [
            (
                eviction.label(pattern),
                "plain LRU (before)" if pool == "before" else "tail-first",
                "model" if pool == "before" else pool,
                f"{r['reachable']:.1%} ({r['reachable_min']:.1%})",
                f"{r['hit_rate']:.1%}",
            )
            for (pattern, pool), r in by.items()
        ],
    )
    report.table(
        "eviction: tail-first (local) over plain LRU",
        ["saves", "reachable", "hit rate"],
        [
            (pattern, f"x{q['reachable']:.3f}", f"x{q['hit_rate']:.3f}")
            for pattern, q in ev["ratio"].items()
        ],
    )
    q = ev["context_ratio"]
    report.table(
        "eviction: new-chunk saves naming the chunks before (local) over not naming them",
        ["reachable", "worst point", "hit rate"],
        [(f"x{q['reachable']:.3f}", f"x{q['reachable_min']:.3f}", f"x{q['hit_rate']:.3f}")],
    )


def plot(result: dict[str, Any], path: str) -> None:
    """Throughput of save and load on each pool (copy alone, and whole request; left), the
    server round trips per request batch against the layer count (middle), and what eviction
    leaves of use, before and after (right)."""
    t = result["throughput"]
    fig, (bars, trips, kept) = figure(1, 3, figsize=(18, 4.6))
    labels = ["save copy", "load copy", "save request", "load request"]
    keys = ["save_copy", "load_copy", "save", "load"]
    x = np.arange(len(keys))
    for offset, kind, color in ((-0.2, "local", "tab:gray"), (0.2, "shared", "tab:blue")):
        values = [t["gbps"][kind][k] for k in keys]
        bars.bar(x + offset, values, width=0.4, color=color, label=kind)
    for i, key in enumerate(keys):
        ratio = t["gbps"]["shared"][key] / t["gbps"]["local"][key]
        top = max(t["gbps"]["local"][key], t["gbps"]["shared"][key])
        bars.annotate(
            f"x{ratio:.2f}", (x[i], top), xytext=(0, 4), textcoords="offset points", ha="center"
        )
    bars.set_xticks(x, labels)
    bars.set(
        ylabel="GB/s (median)", title=f"shared vs local pool, {fmt_bytes(t['bytes'])} per request"
    )
    bars.legend()
    rows = result["round_trips"]
    layers = [r["layers"] for r in rows]
    trips.plot(layers, [r["save"] for r in rows], marker="o", label="save")
    trips.plot(layers, [r["load"] for r in rows], marker="s", label="lookup + load")
    trips.set(
        xlabel="layers", ylabel="requests to the server", title="metadata round trips per batch"
    )
    trips.set_ylim(0, max(r["load"] for r in rows) + 2)
    trips.grid(alpha=0.3)
    trips.legend()
    _plot_eviction(kept, result["eviction"])
    save(fig, path)


def _plot_eviction(ax: Any, ev: dict[str, Any]) -> None:
    by = {(r["pattern"], r["pool"]): r for r in ev["rows"]}
    labels = [
        f"{what}\n{pattern} saves"
        for pattern in eviction.PATTERNS
        for what in ("reachable", "hit rate")
    ]
    x = np.arange(len(labels))
    for offset, pool, color, name in (
        (-0.2, "before", "tab:gray", "plain LRU (before)"),
        (0.2, "local", "tab:blue", "tail-first"),
    ):
        values = [
            by[pattern, pool][what] * 100
            for pattern in eviction.PATTERNS
            for what in ("reachable", "hit_rate")
        ]
        ax.bar(x + offset, values, width=0.4, color=color, label=name)
    ax.set_xticks(x, labels)
    ax.set(
        ylabel="%",
        ylim=(0, 119),
        title=f"eviction: {ev['requests']} requests, pool of {ev['pool_chunks']} chunks",
    )
    ax.legend(loc="upper center", ncol=2)
