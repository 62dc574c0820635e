"""``kvflow bench mooncake``: kvflow's layerwise transfers through Mooncake Store against
Mooncake's own whole-object batch calls moving the same bytes, in one run, on one client.

* throughput: per round, a request of ``blocks`` blocks is saved and loaded layer by layer
  through a TransferEngine on a MooncakeStore (one ``batch_put_session_start``, one ranged put
  per layer, ``batch_put_session_end``; the same shape for the load), and the same number of
  objects of the same size is moved by raw ``batch_put_from`` / ``batch_get_into`` on the same
  client from and into one contiguous buffer. Rounds alternate which goes first; the figure of
  merit is kvflow / raw of the whole request (target >= 0.90 both ways). Every round's loaded
  bytes are checked, and its objects removed so the segment never fills.
* master round trips per request batch, counted by the store (``stats().master_calls``) for a
  save and for a lookup + load at several layer counts, with the ranged transfer calls and the
  local copies (loads read straight from the store's own segment) beside them: the round trips
  stay constant, the per-layer calls grow with the layers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvflow.bench.args import count, fmt_bytes, int_list, pick, size_arg
from kvflow.bench.plots import figure, save
from kvflow.bench.report import Report
from kvflow.bench.setups import small_layout
from kvflow.bench.stores import mooncake_store
from kvflow.config import EngineConfig
from kvflow.errors import KVFlowError, StoreError
from kvflow.keys import chunk_hashes, token_array
from kvflow.layout import KVLayout
from kvflow.pipeline.engine import TransferEngine
from kvflow.results import ChunkStatus
from kvflow.stores.mooncake import MooncakeStore

__all__ = ["DESCRIPTION", "add_arguments", "plot", "run"]

DESCRIPTION = (
    "Mooncake Store: layerwise save/load vs raw batch_put_from/batch_get_into; round trips"
)
CHUNK = 16
MODEL = "kvflow-bench-mooncake"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=count, default=None, help="layers (32; quick 16)")
    parser.add_argument(
        "--block-bytes", type=size_arg, default=None, help="bytes per block per layer (32KiB)"
    )
    parser.add_argument("--blocks", type=count, default=None, help="blocks per request (128; 64)")
    parser.add_argument("--repeats", type=count, default=None, help="measured rounds (7; 3)")
    parser.add_argument(
        "--copy-threads", type=count, default=2, help="kvflow's copy threads (EngineConfig)"
    )
    parser.add_argument(
        "--round-trip-layers", type=int_list, default=[8, 32, 61], help="layer counts counted"
    )


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    layers = pick(args.layers, args.quick, 32, 16)
    block_bytes = pick(args.block_bytes, args.quick, 32 << 10, 32 << 10)
    blocks = pick(args.blocks, args.quick, 128, 64)
    repeats = pick(args.repeats, args.quick, 7, 3)
    if blocks % CHUNK or blocks < CHUNK:
        raise KVFlowError(f"--blocks must be a multiple of {CHUNK}, got {blocks}")
    tensors, layout = small_layout(layers, 2 * blocks, block_bytes)
    nbytes = layout.object_bytes(CHUNK) * (blocks // CHUNK)
    report.note(
        f"mooncake: {layers} layers x {blocks} blocks x {fmt_bytes(block_bytes)} = "
        f"{fmt_bytes(nbytes)} per request, {repeats} rounds after a warm-up"
    )
    with mooncake_store(4 * nbytes + (64 << 20)) as store:
        throughput = asyncio.run(
            _throughput(store, layout, tensors, blocks, repeats, args.copy_threads, report)
        )
        round_trips = [
            {"layers": n, **asyncio.run(_count_round_trips(store, n))}
            for n in args.round_trip_layers
        ]
        sessions_api = store.stats().sessions_api
        local_reads = store.stats().local_endpoint != ""
    del tensors
    result: dict[str, Any] = {
        "mc_store_memcpy": os.environ.get("MC_STORE_MEMCPY", "(unset: Mooncake's default)"),
        "throughput": throughput,
        "round_trips": round_trips,
        "sessions_api": sessions_api,
        "local_reads": local_reads,
    }
    _print(result, report)
    constant = all(len({r[k] for r in round_trips}) == 1 for k in ("save_master", "load_master"))
    result["targets"] = {
        "ratio_ge_0.90": all(v >= 0.9 for v in throughput["ratio"].values()),
        "round_trips_constant": constant,
    }
    result["config"] = {
        "layers": layers,
        "copy_threads": args.copy_threads,
        "block_bytes": block_bytes,
        "blocks": blocks,
        "chunk_blocks": CHUNK,
        "repeats": repeats,
        "quick": bool(args.quick),
    }
    return result


# -- throughput -------------------------------------------------------------------------------


class _Raw:
    """Mooncake's whole-object calls on the store's own client: ``objects`` objects of
    ``object_bytes`` each, from and into contiguous buffers registered with the client."""

    def __init__(self, store: MooncakeStore, objects: int, object_bytes: int) -> None:
        self.store = store
        self.sizes = [object_bytes] * objects
        self.src = np.random.default_rng(1).integers(0, 256, objects * object_bytes, np.uint8)
        self.dst = np.zeros_like(self.src)
        self.src_ptrs = [int(self.src.ctypes.data) + i * object_bytes for i in range(objects)]
        self.dst_ptrs = [int(self.dst.ctypes.data) + i * object_bytes for i in range(objects)]
        for buf in (self.src, self.dst):
            if store.client.register_buffer(int(buf.ctypes.data), buf.nbytes) != 0:
                raise StoreError("Mooncake refused to register the raw reference's buffer")

    def whole(self, rep: int) -> dict[str, float]:
        """``batch_put_from`` then ``batch_get_into``: one call each, whole objects."""
        client = self.store.client
        keys = self._keys("raw", rep)
        self.dst[:] = 0
        t0 = time.perf_counter()
        put = client.batch_put_from(keys, self.src_ptrs, self.sizes, self.store.replicate_config)
        t1 = time.perf_counter()
        got = client.batch_get_into(keys, self.dst_ptrs, self.sizes)
        t2 = time.perf_counter()
        self._check("batch_put_from", put, [0] * len(keys))
        self._check("batch_get_into", got, self.sizes)
        return self._done(keys, t1 - t0, t2 - t1)

    def ranged(self, rep: int, layers: int) -> dict[str, float]:
        """Mooncake's session calls driven directly, one ranged call per layer (each object's
        layer ``l`` is bytes ``[l * size / layers, (l + 1) * size / layers)``): what any
        layerwise client pays for the API, without kvflow."""
        client = self.store.client
        keys = self._keys("ranged", rep)
        n, size = len(keys), self.sizes[0]
        part = size // layers
        self.dst[:] = 0
        t0 = time.perf_counter()
        started = client.batch_put_session_start(keys, self.sizes, self.store.replicate_config)
        for layer in range(layers):
            ptrs = [[p + layer * part] for p in self.src_ptrs]
            moved = client.batch_put_from_multi_buffer_ranges(
                keys, ptrs, [[part]] * n, [[layer * part]] * n
            )
            self._check("ranged put", moved, [part] * n)
        ended = client.batch_put_session_end(keys)
        t1 = time.perf_counter()
        opened = client.batch_get_session_start(keys)
        for layer in range(layers):
            ptrs = [[p + layer * part] for p in self.dst_ptrs]
            moved = client.batch_get_into_multi_buffer_ranges(
                keys, ptrs, [[part]] * n, [[layer * part]] * n
            )
            self._check("ranged get", moved, [part] * n)
        client.batch_get_session_end(keys)
        t2 = time.perf_counter()
        for name, codes in (("put start", started), ("put end", ended), ("get start", opened)):
            self._check(name, codes, [0] * n)
        return self._done(keys, t1 - t0, t2 - t1)

    def _keys(self, kind: str, rep: int) -> list[str]:
        prefix = self.store.config.key_prefix
        return [f"{prefix}{kind}/{rep}/{i}" for i in range(len(self.sizes))]

    @staticmethod
    def _check(what: str, got: list[int], want: list[int]) -> None:
        if [int(g) for g in got] != want:
            raise KVFlowError(f"a raw Mooncake {what} failed: {list(got)[:4]}")

    def _done(self, keys: list[str], save_s: float, load_s: float) -> dict[str, float]:
        if not np.array_equal(self.src, self.dst):
            raise KVFlowError("Mooncake returned other bytes than were put")
        self.store.client.batch_remove(keys, True)
        return {"save_s": save_s, "load_s": load_s}

    def close(self) -> None:
        for buf in (self.src, self.dst):
            self.store.client.unregister_buffer(int(buf.ctypes.data))


async def _kvflow_round(
    engine: TransferEngine, store: MooncakeStore, tensors: list[torch.Tensor], blocks: int, rep: int
) -> dict[str, float]:
    tokens = np.random.default_rng(rep).integers(0, 1 << 30, blocks * 16)
    src, dst = np.arange(blocks), np.arange(blocks, 2 * blocks)
    for t in tensors:
        t[dst] = 0
    t0 = time.perf_counter()
    saved = await engine.save(tokens, src)
    t1 = time.perf_counter()
    loaded = await engine.load(tokens, dst)
    t2 = time.perf_counter()
    if min(r.count(ChunkStatus.OK) for r in (saved, loaded)) != blocks // CHUNK:
        raise KVFlowError(f"a kvflow transfer through Mooncake failed: {saved} / {loaded}")
    if not all(torch.equal(t[src], t[dst]) for t in tensors):
        raise KVFlowError("kvflow loaded other bytes than it saved")
    hashes = chunk_hashes(token_array(tokens), CHUNK * 16)
    store.client.batch_remove(
        [store.config.key_prefix + k for k in engine.keyspace.keys(hashes)], True
    )
    return {"save_s": t1 - t0, "load_s": t2 - t1}


async def _throughput(
    store: MooncakeStore,
    layout: KVLayout,
    tensors: list[torch.Tensor],
    blocks: int,
    repeats: int,
    copy_threads: int,
    report: Report,
) -> dict[str, Any]:
    objects = blocks // CHUNK
    nbytes = layout.object_bytes(CHUNK) * objects
    raw = _Raw(store, objects, layout.object_bytes(CHUNK))
    rounds: dict[str, list[dict[str, float]]] = {"raw": [], "ranged": [], "kvflow": []}
    config = EngineConfig(model=MODEL, chunk_blocks=CHUNK, copy_threads=copy_threads)
    try:
        async with TransferEngine(layout, store, config) as engine:
            with report.progress(repeats + 1, "mooncake throughput") as bar:
                for rep in range(repeats + 1):  # round 0 warms up (connections, first touch)
                    order = list(rounds)
                    for who in order[rep % 3 :] + order[: rep % 3]:  # rotate who goes first
                        if who == "raw":
                            r = await asyncio.to_thread(raw.whole, rep)
                        elif who == "ranged":
                            r = await asyncio.to_thread(raw.ranged, rep, layout.num_layers)
                        else:
                            r = await _kvflow_round(engine, store, tensors, blocks, rep)
                        if rep:
                            rounds[who].append(r)
                    bar.step(f"round {rep}")
    finally:
        raw.close()
    gbps = {
        who: {
            k: nbytes / statistics.median(r[f"{k}_s"] for r in rs) / 1e9 for k in ("save", "load")
        }
        for who, rs in rounds.items()
    }
    return {
        "bytes": nbytes,
        "objects": objects,
        "copy_threads": copy_threads,
        "gbps": gbps,
        "ratio": {k: gbps["kvflow"][k] / gbps["raw"][k] for k in ("save", "load")},
        "ratio_to_ranged": {k: gbps["kvflow"][k] / gbps["ranged"][k] for k in ("save", "load")},
    }


# -- master round trips -----------------------------------------------------------------------


async def _count_round_trips(store: MooncakeStore, layers: int) -> dict[str, int]:
    tensors, layout = small_layout(layers, 64, 256)
    config = EngineConfig(model=f"{MODEL}-trips-{layers}", chunk_blocks=CHUNK // 4)
    tokens = np.random.default_rng(layers).integers(0, 1 << 30, 32 * 16)
    async with TransferEngine(layout, store, config) as engine:
        s0 = store.stats()
        saved = await engine.save(tokens, np.arange(32))
        s1 = store.stats()
        hit = await engine.lookup(tokens)
        loaded = await engine.load(tokens[:hit], np.arange(32, 64))
        s2 = store.stats()
    del tensors
    if not (saved.ok and loaded.ok and hit == len(tokens)):
        raise KVFlowError("the round-trip count's transfers failed")
    return {
        "save_master": s1.master_calls - s0.master_calls,
        "save_transfers": s1.copy_calls - s0.copy_calls,
        "load_master": s2.master_calls - s1.master_calls,
        "load_transfers": s2.copy_calls - s1.copy_calls,
        "load_local": s2.local_copies - s1.local_copies,
    }


def _print(result: dict[str, Any], report: Report) -> None:
    t = result["throughput"]
    g = t["gbps"]
    report.table(
        f"throughput, {t['objects']} objects, {fmt_bytes(t['bytes'])} per request "
        f"(GB/s, median; kvflow with {t['copy_threads']} copy threads)",
        ["", "raw whole objects", "ranged per layer", "kvflow", "kvflow/raw", "kvflow/ranged"],
        [
            (
                k,
                f"{g['raw'][k]:.2f}",
                f"{g['ranged'][k]:.2f}",
                f"{g['kvflow'][k]:.2f}",
                f"{t['ratio'][k]:.3f}",
                f"{t['ratio_to_ranged'][k]:.3f}",
            )
            for k in ("save", "load")
        ],
    )
    report.table(
        "Mooncake calls per request batch (counted by the store)",
        [
            "layers",
            "save: master",
            "save: transfers",
            "lookup+load: master",
            "load: transfers",
            "load: local copies",
        ],
        [
            (
                r["layers"],
                r["save_master"],
                r["save_transfers"],
                r["load_master"],
                r["load_transfers"],
                r["load_local"],
            )
            for r in result["round_trips"]
        ],
    )


def plot(result: dict[str, Any], path: str) -> None:
    """Save and load throughput of the three ways (left) and the Mooncake calls per request
    batch against the layer count (right)."""
    t = result["throughput"]
    fig, (bars, calls) = figure(1, 2, figsize=(12, 4.6))
    x = np.arange(2)
    ways = (("raw", "raw whole objects", "tab:gray"), ("ranged", "ranged per layer", "tab:olive"))
    for offset, (who, label, color) in zip((-0.27, 0.0), ways, strict=True):
        bars.bar(
            x + offset,
            [t["gbps"][who][k] for k in ("save", "load")],
            0.27,
            color=color,
            label=label,
        )
    kv = [t["gbps"]["kvflow"][k] for k in ("save", "load")]
    bars.bar(x + 0.27, kv, 0.27, color="tab:blue", label="kvflow layerwise")
    for i, k in enumerate(("save", "load")):
        bars.annotate(
            f"x{t['ratio'][k]:.2f} of raw", (x[i] + 0.27, kv[i]), xytext=(0, 4),
            textcoords="offset points", ha="center",
        )  # fmt: skip
    bars.set_xticks(x, ["save", "load"])
    bars.set(ylabel="GB/s (median)", title=f"Mooncake, {fmt_bytes(t['bytes'])} per request")
    bars.legend()
    rows = result["round_trips"]
    layers = [r["layers"] for r in rows]
    calls.plot(layers, [r["save_master"] for r in rows], marker="o", label="save: master")
    calls.plot(layers, [r["load_master"] for r in rows], marker="s", label="lookup+load: master")
    calls.plot(layers, [r["load_transfers"] for r in rows], ls="--", label="load: transfer calls")
    calls.plot(layers, [r["load_local"] for r in rows], ls=":", label="load: local copies")
    calls.set(xlabel="layers", ylabel="calls per request batch", title="Mooncake calls per batch")
    calls.set_yscale("log")
    calls.grid(alpha=0.3)
    calls.legend()
    save(fig, path)
