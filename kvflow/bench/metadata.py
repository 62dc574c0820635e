"""``kvflow bench metadata``: store metadata calls and keys per request, kvflow against a
per-(layer, block) key scheme.

Both schemes save one request and then load it back (and the bytes are checked) through the
same kind of ``LocalStore``, wrapped in kvflow's ``InstrumentedStore`` (a proxy ``Store`` that
counts every call and the keys it carries): the figures are counted, not computed.

* kvflow: a ``TransferEngine`` (chunk_blocks=16): ``save``, then ``lookup`` and ``load``. One
  pool object per chunk holds every layer, so the store sees ``open_write`` + ``finish_write``
  and ``lookup`` + ``open_read`` + ``close_read`` whatever the layer count.
* per-(layer, block): one object per layer and block, keyed by the block's prefix hash and the
  layer; a save opens, copies and commits each layer as it is written, a load looks the prefix
  up once and then opens, copies and releases each layer.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np
import torch

from kvflow.bench.args import int_list, pick
from kvflow.bench.plots import figure, format_axes, save
from kvflow.bench.report import Report
from kvflow.bench.setups import CHUNK_BLOCKS, small_layout, store_for
from kvflow.bench.timing import load_average
from kvflow.config import EngineConfig
from kvflow.keys import chunk_hashes
from kvflow.layout import KVLayout
from kvflow.pipeline.engine import TransferEngine
from kvflow.results import ChunkStatus
from kvflow.stores.base import Direction
from kvflow.testing import METADATA_CALLS, InstrumentedStore

__all__ = ["DESCRIPTION", "add_arguments", "plot", "run"]

DESCRIPTION = "store metadata calls and keys per request: kvflow vs a per-(layer, block) scheme"
BLOCK_BYTES = 64  # bytes per block per layer: tiny, the scenario counts calls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers", type=int_list, default=[8, 16, 32, 61], help="layer counts (8,16,32,61)"
    )
    parser.add_argument(
        "--tokens", type=int_list, default=None, help="tokens per request (4096,16384,65536)"
    )


def _take(store: InstrumentedStore, start: float) -> dict[str, Any]:
    """What the store was asked since the last ``_take`` (or ``start``), and reset."""
    counts = {
        "calls": {k: v for k, v in store.calls.items() if k != "batch_copy"},
        "metadata_calls": store.metadata_calls,
        "keys_in_calls": sum(store.keys.get(k, 0) for k in METADATA_CALLS),
        "objects": store.keys.get("open_write", 0),
        "batch_copy_calls": store.calls.get("batch_copy", 0),
        "ms": (time.perf_counter() - start) * 1e3,
    }
    store.reset()
    return counts


Flow = tuple[dict[str, Any], dict[str, Any], bool]  # save counts, load counts, all found


async def _kvflow(
    layout: KVLayout, tensors: list[torch.Tensor], tokens: np.ndarray, store: InstrumentedStore
) -> Flow:
    blocks = np.arange(layout.num_blocks, dtype=np.int64)  # a fresh prefill's blocks
    config = EngineConfig(model="bench-metadata", chunk_blocks=CHUNK_BLOCKS)
    async with TransferEngine(layout, store, config) as engine:
        store.reset()  # registration is once per engine, not per request
        start = time.perf_counter()
        saved = await engine.save(tokens, blocks)
        save = _take(store, start)
        _zero(tensors)
        start = time.perf_counter()
        hit = await engine.lookup(tokens)
        loaded = await engine.load(tokens[:hit], blocks[: hit // layout.block_size])
        load = _take(store, start)
    chunks = layout.num_blocks // CHUNK_BLOCKS
    ok = (
        hit == len(tokens) and saved.count(ChunkStatus.OK) == loaded.count(ChunkStatus.OK) == chunks
    )
    return save, load, ok


def _per_layer_block(
    layout: KVLayout, tensors: list[torch.Tensor], tokens: np.ndarray, store: InstrumentedStore
) -> Flow:
    hashes = [h.hex() for h in chunk_hashes(tokens, layout.block_size)]  # one per block
    keys = [[f"{h}/layer{i}" for h in hashes] for i in range(layout.num_layers)]
    parts = [parts[0] for parts in layout.layers]
    local = [p.base + np.arange(len(hashes), dtype=np.int64) * p.block_stride for p in parts]
    sizes = np.full(len(hashes), parts[0].block_bytes, dtype=np.int64)
    store.register(layout.regions())
    store.reset()
    start = time.perf_counter()
    for i in range(layout.num_layers):  # each layer as it is written
        write = store.open_write(keys[i], parts[i].block_bytes)
        store.batch_copy(write.addrs, local[i], sizes, Direction.TO_POOL)
        store.finish_write(write, write.granted)
    save = _take(store, start)
    _zero(tensors)
    start = time.perf_counter()
    ok = bool(store.lookup(keys[0]).all())  # the prefix hit
    for i in range(layout.num_layers):
        read = store.open_read(keys[i])
        ok &= bool(read.found.all())
        store.batch_copy(read.addrs, local[i], sizes, Direction.FROM_POOL)
        store.close_read(read)
    load = _take(store, start)
    return save, load, ok


def _zero(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.zero_()


def _request(layers: int, n_tokens: int, scheme: str) -> dict[str, Any]:
    """Save and load one request with ``scheme``; its counts, checked bytes included."""
    blocks = n_tokens // 16
    tensors, layout = small_layout(layers, blocks, BLOCK_BYTES, seed=layers + n_tokens)
    expected = [t.clone() for t in tensors]
    tokens = np.random.default_rng(n_tokens).integers(0, 50_000, n_tokens, dtype=np.int64)
    if scheme == "kvflow":
        inner = store_for(layout, CHUNK_BLOCKS, blocks // CHUNK_BLOCKS)
    else:
        inner = store_for(layout, 1, blocks * layers)  # room for one slot per (layer, block)
    store = InstrumentedStore(inner)
    try:
        if scheme == "kvflow":
            save, load, ok = asyncio.run(_kvflow(layout, tensors, tokens, store))
        else:
            save, load, ok = _per_layer_block(layout, tensors, tokens, store)
    finally:
        store.close()
    if not (ok and all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))):
        raise RuntimeError(f"{scheme}: the round trip lost data ({layers} layers, {n_tokens})")
    return {
        "calls_per_request": save["metadata_calls"] + load["metadata_calls"],
        "keys_per_request": save["objects"],  # the objects (keys) the save created
        "keys_in_calls": save["keys_in_calls"] + load["keys_in_calls"],
        "batch_copy_calls": save["batch_copy_calls"] + load["batch_copy_calls"],
        "save_calls": save["calls"],
        "load_calls": load["calls"],
        "save_ms": round(save["ms"], 2),
        "load_ms": round(load["ms"], 2),
    }


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    token_counts = pick(args.tokens, args.quick, [4096, 16384, 65536], [4096, 16384])
    loadavg = load_average()
    _request(min(args.layers), min(token_counts), "kvflow")  # the process's first-use costs
    rows = []
    with report.progress(len(token_counts) * len(args.layers), "metadata") as bar:
        for n_tokens in token_counts:
            for layers in args.layers:
                kv = _request(layers, n_tokens, "kvflow")
                pl = _request(layers, n_tokens, "per_layer_block")
                blocks = n_tokens // 16
                rows.append(
                    {
                        "layers": layers,
                        "tokens": n_tokens,
                        "blocks": blocks,
                        "chunks": blocks // CHUNK_BLOCKS,
                        "kvflow_calls_per_request": kv["calls_per_request"],
                        "kvflow_keys_per_request": kv["keys_per_request"],
                        "per_layer_calls_per_request": pl["calls_per_request"],
                        "per_layer_keys_per_request": pl["keys_per_request"],
                        "key_ratio": round(pl["keys_per_request"] / kv["keys_per_request"], 2),
                        # the part of key_ratio due to one object holding every layer; the
                        # rest (chunk_blocks) is from one key per chunk rather than per block
                        "layer_factor": round(
                            pl["keys_per_request"] / kv["keys_per_request"] / CHUNK_BLOCKS, 2
                        ),
                        "kvflow": kv,
                        "per_layer_block": pl,
                    }
                )
                bar.step(f"{layers} layers {n_tokens} tokens")
    kv_calls = {r["kvflow_calls_per_request"] for r in rows}
    layers_fewer = all(r["layer_factor"] == r["layers"] for r in rows)
    report.table(
        f"metadata: one request saved, then looked up and loaded; chunk_blocks={CHUNK_BLOCKS}, "
        f"16 tokens per block; counted at the store",
        [
            "tokens",
            "layers",
            "chunks",
            "kvflow calls",
            "per-layer calls",
            "kvflow keys",
            "per-layer keys",
            "fewer keys",
            "/ chunk_blocks",
            "batch_copy calls",
            "kvflow save/load ms",
            "per-layer save/load ms",
        ],
        [
            [
                r["tokens"],
                r["layers"],
                r["chunks"],
                r["kvflow_calls_per_request"],
                r["per_layer_calls_per_request"],
                r["kvflow_keys_per_request"],
                r["per_layer_keys_per_request"],
                f"{r['key_ratio']:.0f}x",
                f"{r['layer_factor']:.0f}x",
                f"{r['kvflow']['batch_copy_calls']}/{r['per_layer_block']['batch_copy_calls']}",
                f"{r['kvflow']['save_ms']:.1f}/{r['kvflow']['load_ms']:.1f}",
                f"{r['per_layer_block']['save_ms']:.1f}/{r['per_layer_block']['load_ms']:.1f}",
            ]
            for r in rows
        ],
    )
    report.line(
        f"kvflow: {sorted(kv_calls)} metadata calls per request over {args.layers} layers "
        f"({'constant' if len(kv_calls) == 1 else 'NOT constant'}); keys = chunks, "
        f"layers x chunk_blocks ({CHUNK_BLOCKS}) times fewer than the layers x blocks of the "
        f"per-(layer, block) scheme: `layers` times fewer per chunk "
        f"({'holds' if layers_fewer else 'does NOT hold'} in every row)"
    )
    return {
        "scenario": "metadata",
        "chunk_blocks": CHUNK_BLOCKS,
        "block_size": 16,
        "kvflow_calls_constant_in_layers": len(kv_calls) == 1,
        "keys_layers_times_fewer": layers_fewer,
        "loadavg_start": loadavg,
        "rows": rows,
    }


def plot(result: dict[str, Any], path: str) -> None:
    """Store metadata calls per request (left) and keys per request (right) against the layer
    count, kvflow and per-(layer, block), one line per prompt length (log scales)."""
    rows = result["rows"]
    layers = sorted({r["layers"] for r in rows})
    tokens = sorted({r["tokens"] for r in rows})
    markers = "osD^v<>"
    fig, (calls, keys) = figure(1, 2, figsize=(12, 4.8))
    for scheme, prefix, color in (
        ("kvflow", "kvflow", "tab:blue"),
        ("per-(layer, block)", "per_layer", "tab:red"),
    ):
        for i, n in enumerate(tokens):
            mine = sorted((r for r in rows if r["tokens"] == n), key=lambda r: r["layers"])
            x = [r["layers"] for r in mine]
            style = {"color": color, "marker": markers[i % len(markers)], "alpha": 0.85}
            label = f"{scheme}, {n} tokens"
            n_calls = [r[f"{prefix}_calls_per_request"] for r in mine]
            calls.plot(x, n_calls, **style, label=label)
            if i == 0:  # the count at the most layers, written beside the line
                calls.annotate(
                    f"{n_calls[-1]}",
                    (x[-1], n_calls[-1]),
                    xytext=(6, 0),
                    va="center",
                    textcoords="offset points",
                    color=color,
                )
            keys.plot(x, [r[f"{prefix}_keys_per_request"] for r in mine], **style, label=label)
    calls.margins(x=0.1)  # room for the counts written at the right
    calls.set(ylabel="store metadata calls per request", title="calls (save + lookup + load)")
    keys.set(ylabel="keys (objects) per request", title="keys the save creates")
    format_axes((calls, keys), "layers", layers)
    keys.legend(fontsize=8)
    fig.suptitle(
        f"metadata per request, counted at the store: chunk_blocks={result['chunk_blocks']}, "
        f"{result['block_size']} tokens per block"
    )
    save(fig, path)
