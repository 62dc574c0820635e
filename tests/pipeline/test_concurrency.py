"""Many concurrent saves and loads with overlapping prefixes: no torn read, eviction under
pressure never touches a leased object, and every loaded byte is the byte that was saved."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import kvflow
from tests.support.pools import ARENA_STORE_NAMES, dispose, make_store, open_sessions

BS = 4
CHUNK = 2
LAYERS = 3
BLOCKS = 256
WIDTH = 32  # bytes per block per layer


def content(tokens: np.ndarray, layer: int) -> np.ndarray:
    """The KV a prefix deterministically has: per block, bytes derived from the tokens so far."""
    blocks = len(tokens) // BS
    out = np.empty((blocks, WIDTH), dtype=np.uint8)
    for b in range(blocks):
        seed = hash((tuple(tokens[: (b + 1) * BS].tolist()), layer)) & 0xFFFFFFFF
        out[b] = np.random.default_rng(seed).integers(0, 256, WIDTH, dtype=np.uint8)
    return out


async def test_concurrent_overlapping_saves_and_loads_are_exact(store_name: str) -> None:
    caches = [torch.zeros(BLOCKS, WIDTH, dtype=torch.uint8) for _ in range(LAYERS)]
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    # room for ~24 objects: constant eviction while requests run
    store = make_store(store_name, 24 * 4096)
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, prefetch_layers=1, copy_threads=2)
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(0, 9, 16) for _ in range(4)]
    free = asyncio.Queue()
    for b in range(0, BLOCKS, 8):
        free.put_nowait(b)  # 32 slots of 8 blocks (= 32 tokens) each
    checked = {"loaded_chunks": 0, "missing": 0}

    async def one(i: int) -> None:
        r = np.random.default_rng(i)
        tokens = np.concatenate([prefixes[i % 4], r.integers(0, 9, 16)])  # 32 tokens, 4 chunks
        base = await free.get()
        blocks = np.arange(base, base + 8)
        try:
            for layer in range(LAYERS):
                caches[layer][blocks] = torch.from_numpy(content(tokens, layer))
            if i % 2 == 0:
                result = await engine.save(tokens, blocks)
                assert result.count(kvflow.ChunkStatus.FAILED) == 0
            for layer in range(LAYERS):
                caches[layer][blocks] = 0
            result = await engine.load(tokens, blocks)
            req = result.requests[0]
            ok = req.ok_block_ids
            for layer in range(LAYERS):
                want = content(tokens, layer)
                got = caches[layer][blocks].numpy()
                for k, block in enumerate(blocks):
                    if block in ok:
                        assert (got[k] == want[k]).all(), f"torn or wrong bytes in block {block}"
            checked["loaded_chunks"] += req.count(kvflow.ChunkStatus.OK)
            checked["missing"] += req.count(kvflow.ChunkStatus.MISSING)
        finally:
            free.put_nowait(base)

    async with kvflow.TransferEngine(layout, store, cfg) as engine:
        await asyncio.gather(*(one(i) for i in range(200)))
    assert open_sessions(store) == 0
    usage = store.usage()
    if usage is not None:  # an arena of 24 objects: eviction all along
        assert usage.leases == 0 and usage.pending_writes == 0
        assert usage.evictions > 0, "the pool never filled: the test did not exercise eviction"
    assert checked["loaded_chunks"] > 50
    assert checked["missing"] > 0 or usage is None
    dispose(store)


@pytest.mark.parametrize("store_name", ARENA_STORE_NAMES)
async def test_eviction_never_touches_a_leased_object(store_name: str) -> None:
    caches = [torch.randint(0, 256, (BLOCKS, WIDTH), dtype=torch.uint8) for _ in range(LAYERS)]
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = make_store(store_name, 4 * 4096)  # four objects
    cfg = kvflow.EngineConfig(chunk_blocks=CHUNK, prefetch_layers=1)
    async with kvflow.TransferEngine(layout, store, cfg) as e:
        held = np.arange(8)  # one chunk
        assert (await e.save(held, [0, 1])).ok
        handle = await e.start_load([(held, [100, 101])])  # lease taken, not consumed yet
        for i in range(1, 20):  # churn: every save needs an eviction
            await e.save(np.arange(8) + 1000 * i, [2 * i, 2 * i + 1])
        assert store.usage().evictions > 10
        assert (await handle.wait()).ok
        for c in caches:
            assert torch.equal(c[100:102], c[0:2])
