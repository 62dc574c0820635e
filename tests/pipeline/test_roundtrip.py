"""Bit-exact save -> load round trips over random layouts, block ids and token sequences."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvflow
from tests.support.pools import STORE_NAMES, dispose, long_lived_store, make_store, release_store

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included, must survive)."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * item), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def build(kind: str, layers: int, parts: int, blocks: int, dtype: torch.dtype, seed: int):
    """Caches of one of kvflow's layout kinds, and the per-layer list of block-indexed tensors."""
    gen = torch.Generator().manual_seed(seed)
    bs = 4
    if kind == "kv_split":
        caches = [random_tensor((2, blocks, bs, 2, 8), dtype, gen) for _ in range(layers)]
        layout = kvflow.KVLayout.from_kv_split_tensors(caches, block_size=bs)
        views = [[c[0], c[1]] for c in caches]
    elif kind == "mla":
        caches = [random_tensor((blocks, bs, 24), dtype, gen) for _ in range(layers)]
        layout = kvflow.KVLayout.from_mla_tensors(caches, block_size=bs)
        views = [[c] for c in caches]
    else:
        caches = [
            tuple(random_tensor((blocks, bs, 3 + p), dtype, gen) for p in range(parts))
            for _ in range(layers)
        ]
        layout = kvflow.KVLayout.from_tensors(caches, block_size=bs)
        views = [list(c) for c in caches]
    return layout, views


def zeros_like_views(views):
    out = []
    for layer in views:
        out.append([torch.zeros_like(t) for t in layer])
    return out


_RUNS = itertools.count()


async def _roundtrip(
    kind, layers, parts, dtype, chunk_blocks, prompts, seed, max_bytes, store_name
):
    num_blocks = 64
    src_layout, src = build(kind, layers, parts, num_blocks, dtype, seed)
    dst = zeros_like_views(src)
    if kind == "kv_split":
        dst_caches = [torch.stack(layer) for layer in dst]
        dst_layout = kvflow.KVLayout.from_kv_split_tensors(dst_caches, block_size=4)
        dst = [[c[0], c[1]] for c in dst_caches]
    elif kind == "mla":
        dst_layout = kvflow.KVLayout.from_mla_tensors([v[0] for v in dst], block_size=4)
    else:
        dst_layout = kvflow.KVLayout.from_tensors([tuple(v) for v in dst], block_size=4)
    assert dst_layout.fingerprint() == src_layout.fingerprint()
    model = f"roundtrip-{next(_RUNS)}"  # keys of its own, also on a long-lived pool
    cfg = kvflow.EngineConfig(model=model, chunk_blocks=chunk_blocks, max_transfer_bytes=max_bytes)
    rng = np.random.default_rng(seed)
    store = long_lived_store(store_name, "32MiB")
    try:
        async with (
            kvflow.TransferEngine(src_layout, store, cfg) as saver,
            kvflow.TransferEngine(dst_layout, store, cfg) as loader,
        ):
            # save every prompt from random (shuffled) source blocks
            saved_from: dict[str, np.ndarray] = {}
            for tokens in prompts:
                n_blocks = -(-len(tokens) // 4)
                blocks = rng.permutation(num_blocks)[:n_blocks]
                result = await saver.save(tokens, blocks)
                assert result.ok
                plan = saver.plan([(tokens, blocks)], load=False)
                for c, key in enumerate(plan.keys):
                    saved_from.setdefault(key, blocks[c * chunk_blocks : (c + 1) * chunk_blocks])
            # load every prompt into distinct destination blocks and compare with the source
            for tokens in prompts:
                hit = await loader.lookup(tokens)
                chunk_tokens = chunk_blocks * 4
                assert hit == (len(tokens) // chunk_tokens) * chunk_tokens
                n_blocks = -(-hit // 4)
                targets = rng.permutation(num_blocks)[:n_blocks]
                result = await loader.load(tokens[:hit], targets)
                assert result.ok, result
                plan = loader.plan([(tokens[:hit], targets)], load=True)
                for c, key in enumerate(plan.keys):
                    origin = saved_from[key]
                    here = targets[c * chunk_blocks : (c + 1) * chunk_blocks]
                    for layer in range(layers):
                        for s_part, d_part in zip(src[layer], dst[layer], strict=True):
                            a = s_part[torch.as_tensor(origin)].view(torch.uint8)
                            b = d_part[torch.as_tensor(here)].view(torch.uint8)
                            assert torch.equal(a, b), (key, layer)
    finally:
        release_store(store_name, store)


prompt = st.lists(st.integers(0, 50_000), min_size=0, max_size=70)


@pytest.mark.parametrize("store_name", STORE_NAMES)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["blocks", "kv_split", "mla"]),
    layers=st.integers(1, 64),
    parts=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    chunk_blocks=st.integers(1, 4),
    base=prompt,
    tails=st.lists(prompt, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    max_bytes=st.sampled_from([16, 100, 1 << 20]),
)
def test_roundtrip_is_bit_exact(
    kind, layers, parts, dtype, chunk_blocks, base, tails, seed, max_bytes, store_name
):
    # requests share the prefix `base`, so their first chunks share keys
    prompts = [np.array(base + t, dtype=np.int64) for t in tails]
    asyncio.run(
        _roundtrip(kind, layers, parts, dtype, chunk_blocks, prompts, seed, max_bytes, store_name)
    )


def test_shared_prefix_is_stored_once(caches, layout, store_name):
    async def main():
        store = make_store(store_name, "16MiB")
        cfg = kvflow.EngineConfig(chunk_blocks=2)
        async with kvflow.TransferEngine(layout, store, cfg) as engine:
            prefix = list(range(64))  # two chunks of 2 blocks x 16 tokens
            a = np.array(prefix + [1] * 32)
            b = np.array(prefix + [2] * 32)
            ra = await engine.save(a, np.arange(6))
            rb = await engine.save(b, np.arange(10, 16))
            assert ra.count(kvflow.ChunkStatus.OK) == 3
            assert rb.count(kvflow.ChunkStatus.EXISTS) == 2
            assert rb.count(kvflow.ChunkStatus.OK) == 1
            usage = store.usage()
            assert usage is None or usage.objects == 4
        dispose(store)

    asyncio.run(main())


def test_a_load_writes_nothing_into_skip_block_places(store_name):
    """vLLM's own prefix cache may end inside a chunk: the connector then loads the chunk with
    SKIP_BLOCK for the blocks vLLM holds. Those blocks keep their bytes, the others get the
    chunk's, and neither the result nor the stats count a skipped place as moved."""
    skip = kvflow.SKIP_BLOCK

    async def main():
        src_layout, src = build("blocks", 3, 2, 32, torch.float16, seed=7)
        _, dst = build("blocks", 3, 2, 32, torch.float16, seed=8)
        dst_layout = kvflow.KVLayout.from_tensors([tuple(v) for v in dst], block_size=4)
        before = [[t.clone() for t in layer] for layer in dst]
        store = make_store(store_name, "16MiB")
        cfg = kvflow.EngineConfig(model=f"skip-{next(_RUNS)}", chunk_blocks=2)
        tokens = np.arange(24)  # three chunks of two 4-token blocks
        origin = np.array([3, 4, 5, 6, 7, 8])
        targets = np.array([skip, 20, skip, skip, 24, 25])
        async with (
            kvflow.TransferEngine(src_layout, store, cfg) as saver,
            kvflow.TransferEngine(dst_layout, store, cfg) as loader,
        ):
            assert (await saver.save(tokens, origin)).ok
            with pytest.raises(kvflow.InvalidArgumentError) as info:
                await saver.save(tokens, targets)  # a save has no place to skip
            assert info.value.argument == "requests[0].block_ids"
            result = await loader.load(tokens, targets)
            assert result.ok, result
            assert result.requests[0].ok_block_ids.tolist() == [20, 24, 25]
            assert loader.stats().blocks_loaded == 3
        for layer in range(3):
            for s_part, d_part, old in zip(src[layer], dst[layer], before[layer], strict=True):
                for origin_block, target in zip(origin, targets, strict=True):
                    if target != skip:
                        got, want = d_part[target], s_part[origin_block]
                        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                untouched = [b for b in range(32) if b not in targets]
                got, want = d_part[untouched], old[untouched]  # bytes: NaNs among them
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        dispose(store)

    asyncio.run(main())
