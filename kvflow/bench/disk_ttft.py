"""TTFT on a prefix hit held on disk only, two ways, on ``kvflow bench ttft``'s synthetic model.

Two ``kvflow serve`` pools, each a DRAM tier exactly as large as the prefix and a disk tier:

* ``disk, layerwise``: ``--disk-reads layerwise``: the client reads layer i+1 of each chunk
  from its file while layer i computes;
* ``disk, promote first``: ``--disk-reads promote``: the server copies the chunks into DRAM
  before it answers the read; then the load runs layer by layer from DRAM.

Before each of those runs the prefix is pushed out of DRAM (another prompt of as many chunks
is saved) and the page cache of every object file is dropped: the bytes come from the disk.
The compute runs on one thread pinned to every CPU but the last, kvflow's copy thread on
the last (as ``kvflow bench ttft`` runs), or (``pinned`` False) on every CPU, the copy thread
beside it. References from the same run: the prefix in the
device cache (``hbm_hit``), the prefix in the pool's DRAM (``dram``), and no hit
(``recompute``). Rounds alternate the two disk pools' order; medians are reported, and every
load's output must equal the ``hbm_hit`` one bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvflow.bench.disk_runs import drop_page_cache, settled, tiered_pool
from kvflow.bench.model import ModelShape
from kvflow.bench.report import Report
from kvflow.bench.timing import compute_pinned
from kvflow.bench.ttft_runs import TtftBench
from kvflow.cpus import affinity
from kvflow.errors import KVFlowError
from kvflow.pool.store import SharedStore
from kvflow.stores.arena import slot_bytes
from kvflow.testing import InstrumentedStore

__all__ = ["MODES", "ttft_on_disk"]

MODES = ("hbm_hit", "dram", "disk_layerwise", "disk_promote", "recompute")


def _ns(tokens: int, new_tokens: int, chunk_blocks: int, seed: int) -> argparse.Namespace:
    return argparse.Namespace(
        tokens=tokens, new_tokens=new_tokens, hit_rate=0.9, chunk_blocks=chunk_blocks,
        seed=seed, device="cpu",
    )  # fmt: skip


def ttft_on_disk(
    shape: ModelShape, tokens: int, new_tokens: int, chunk_blocks: int, repeats: int,
    report: Report, seed: int = 0, pinned: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The runs (see the module's docstring); ``pinned`` False: the compute on every CPU
    (one torch thread each) and the copy thread floating, contending with it."""
    bench = TtftBench(_ns(tokens, new_tokens, chunk_blocks, seed), shape)
    chunk_tokens = chunk_blocks * shape.block_size
    chunks = bench.prefix // chunk_tokens
    size = shape.kv_bytes_per_token_layer * chunk_tokens * shape.layers
    dram = chunks * slot_bytes(size)
    disk = 4 * chunks * (size + (1 << 20))
    other = torch.from_numpy(np.random.default_rng(seed + 1).integers(0, 1 << 30, bench.prefix))
    blocks = bench.hbm_blocks[: bench.prefix // shape.block_size]
    report.note(
        f"disk ttft: {chunks} chunks of {size / 2**20:.0f} MiB on disk, "
        f"{bench.total - bench.prefix} tokens computed, {shape.layers} layers"
    )
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    cpus = affinity()
    copy = (cpus[-1],) if len(cpus) > 1 and pinned else ()
    compute = set(cpus[:-1]) if copy else None
    threads = 1 if copy else len(cpus)
    with compute_pinned(compute, threads):
        t0 = time.perf_counter()
        full = bench.forward(bench.hbm_first, bench.all_pos)  # also fills the prefix KV
        runs["recompute"].append({"ttft": time.perf_counter() - t0, "out": full[bench.prefix :]})
    with (
        tiered_pool(dram, disk, "layerwise") as (layerwise, folder_a),
        tiered_pool(dram, disk, "promote") as (promote, folder_b),
    ):
        pools = {"disk_layerwise": (layerwise, folder_a), "disk_promote": (promote, folder_b)}
        engines = {}
        for mode, (store, _) in pools.items():
            bench.store = InstrumentedStore(store, record_copies=True)
            engines[mode] = (bench.store, bench.engine(2, copy, chunk_blocks))
            _save(engines[mode][1], bench.tokens[: bench.prefix], blocks, store)
        try:
            with report.progress(repeats, "disk ttft") as bar:
                for r in range(repeats):
                    with compute_pinned(compute, threads):
                        runs["hbm_hit"].append(bench.hbm_run())
                    order = list(pools) if r % 2 == 0 else list(reversed(pools))
                    for mode in order:
                        store, folder = pools[mode]
                        bench.store, engine = engines[mode]
                        _save(engine, other, blocks, store)  # the prefix leaves DRAM
                        drop_page_cache(folder)
                        with compute_pinned(compute, threads):
                            runs[mode].append(_timed(bench, engine))
                        settled(store)
                    bench.store, engine = engines["disk_layerwise"]
                    _save(engine, bench.tokens[: bench.prefix], blocks, layerwise)
                    with compute_pinned(compute, threads):
                        runs["dram"].append(_timed(bench, engine))
                    settled(layerwise)
                    bar.step(f"round {r + 1}")
            stats = {mode: store.server_stats() for mode, (store, _) in pools.items()}
        finally:
            for _, engine in engines.values():
                engine.close()
    return {**_summary(runs, stats, chunks, size, bench), "pinned": pinned}


def _save(engine: Any, tokens: torch.Tensor, blocks: torch.Tensor, store: SharedStore) -> None:
    result = engine.save(tokens, blocks)
    if not result.ok:
        raise KVFlowError(f"a save failed: {result}")
    settled(store)


def _timed(bench: TtftBench, engine: Any) -> dict[str, Any]:
    run = bench.load_run(engine, layerwise=True)
    return {"ttft": run["ttft"], "out": run["out"]}


def _summary(
    runs: dict[str, list[dict[str, Any]]],
    stats: dict[str, dict[str, int]],
    chunks: int,
    size: int,
    bench: TtftBench,
) -> dict[str, Any]:
    reference = runs["hbm_hit"][0]["out"]
    exact = all(torch.equal(r["out"], reference) for m in MODES[:4] for r in runs[m])
    ttft = {m: statistics.median(r["ttft"] for r in runs[m]) for m in MODES}
    return {
        "chunks": chunks,
        "object_bytes": size,
        "prefix_tokens": bench.prefix,
        "computed_tokens": bench.total - bench.prefix,
        "ttft_s": ttft,
        "ttft_runs_s": {m: [r["ttft"] for r in runs[m]] for m in MODES},
        "promote_over_layerwise": ttft["disk_promote"] / ttft["disk_layerwise"],
        "layerwise_over_dram": ttft["disk_layerwise"] / ttft["dram"],
        "outputs_identical": exact,
        "disk_reads_served": stats["disk_layerwise"]["disk_reads_served"],
        "promotions": {m: s["promotions"] for m, s in stats.items()},
    }
