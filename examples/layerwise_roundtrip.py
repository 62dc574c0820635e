"""Save a synthetic model's KV cache layer by layer into the embedded pool, load it back into
other blocks layer by layer, check every byte, and print what moved and how fast.

    python examples/layerwise_roundtrip.py [--layers 32] [--tokens 4096] [--pool SIZE]

(the values shown are the defaults; the pool defaults to what the prompt needs)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np
import torch

import kvflow


def memcpy_gbps(nbytes: int) -> float:
    """Reference: numpy.copyto between two warm buffers of ``nbytes``, best of three."""
    a, b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096, help="prompt length")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-blocks", type=int, default=16)
    p.add_argument("--pool", default=None, help="pool capacity (default: what the prompt needs)")
    return p.parse_args()


async def main(args: argparse.Namespace) -> None:
    blocks_per_prompt = -(-args.tokens // args.block_size)
    num_blocks = 2 * blocks_per_prompt
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)  # [K/V, blocks, ...]
    gen = torch.Generator().manual_seed(0)
    caches = [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
        for _ in range(args.layers)
    ]
    layout = kvflow.KVLayout.from_kv_split_tensors(caches, block_size=args.block_size)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    config = kvflow.EngineConfig(
        model="synthetic", chunk_blocks=args.chunk_blocks, copy_cpus=tuple(cpus[-1:])
    )
    tokens = np.random.default_rng(0).integers(0, 32_000, args.tokens)
    src = np.arange(blocks_per_prompt)
    dst = np.arange(blocks_per_prompt, 2 * blocks_per_prompt)
    print(layout)

    chunks = args.tokens // (args.chunk_blocks * args.block_size)
    t0 = time.perf_counter()
    store = kvflow.LocalStore(
        args.pool or (chunks + 1) * layout.object_bytes(args.chunk_blocks), prefault=True
    )
    print(
        f"pool of {store.capacity / (1 << 30):.2f} GiB mapped in {time.perf_counter() - t0:.2f} s"
    )
    async with kvflow.TransferEngine(layout, store, config) as engine:
        t0 = time.perf_counter()
        async with await engine.start_save([kvflow.BlockRequest(tokens, src)]) as save:
            for layer in range(layout.num_layers):  # as the forward pass finishes each layer
                await save.layer_written(layer)
            saved = await save.wait()
        t_save = time.perf_counter() - t0

        hit = await engine.lookup(tokens)
        t0 = time.perf_counter()
        request = kvflow.BlockRequest(tokens[:hit], dst[: hit // args.block_size])
        async with await engine.start_load([request]) as load:
            for layer in range(layout.num_layers):  # as attention reaches each layer
                await load.wait_layer(layer)
            loaded = await load.wait()
        t_load = time.perf_counter() - t0
        stats = engine.stats()

    n = hit // args.block_size
    same = all(
        torch.equal(c[:, dst[:n]].view(torch.int16), c[:, src[:n]].view(torch.int16))
        for c in caches
    )
    gib = 1 << 30
    ref = memcpy_gbps(stats.bytes_saved // layout.num_layers)
    save_gbps = stats.bytes_saved / t_save / 1e9
    load_gbps = stats.bytes_loaded / t_load / 1e9
    print(
        f"saved  {saved}: {stats.bytes_saved / gib:.2f} GiB in {t_save * 1e3:.1f} ms "
        f"({save_gbps:.2f} GB/s, {save_gbps / ref:.0%} of memcpy)"
    )
    print(f"lookup {hit} of {len(tokens)} tokens in the pool")
    print(
        f"loaded {loaded}: {stats.bytes_loaded / gib:.2f} GiB in {t_load * 1e3:.1f} ms "
        f"({load_gbps:.2f} GB/s, {load_gbps / ref:.0%} of memcpy)"
    )
    print(f"memcpy reference, numpy.copyto of one layer's bytes in this run: {ref:.2f} GB/s")
    print(
        f"store metadata calls: {stats.store_metadata_calls} "
        f"(for {layout.num_layers} layers); copy calls: {stats.copy_calls}, "
        f"ranges: {stats.copy_ranges}"
    )
    print(f"pool: {store!r}")
    print("bit-exact:", same)
    store.close()
    if not (same and saved.ok and loaded.ok):
        raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main(parse()))
