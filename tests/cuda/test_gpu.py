"""KV caches on a CUDA GPU, moved by kvflow between device memory and the host pools.

These run only where torch sees a GPU (``benchmarks/gpu_check.sh`` runs them there); elsewhere
they skip, and tests/test_cuda.py covers the same code with the CUDA runtime stood in for.
Every layout vLLM hands over (FlashAttention's ``[2, num_blocks, block_size, heads, dim]``,
``[num_blocks, ...]``, MLA's ``[num_blocks, block_size, dim]``) round-trips bit-exact through
both host pools; saves wait for the compute stream; loads order it after their copies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvflow
from kvflow.abc import Store
from kvflow.devices import CudaDevice
from tests.support.pools import ServedSharedStore, dispose

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BS = 16
LAYERS = 4
BLOCKS = 64
KINDS = ("kv_split", "blocks", "mla")


def _caches(kind: str, seed: int = 0) -> tuple[list[torch.Tensor], kvflow.KVLayout]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = {
        "kv_split": (2, BLOCKS, BS, 8, 128),
        "blocks": (BLOCKS, BS, 8, 128),
        "mla": (BLOCKS, BS, 576),
    }[kind]
    caches = [
        torch.randint(0, 1 << 15, shape, generator=gen, device="cuda", dtype=torch.int16).view(
            torch.bfloat16
        )
        for _ in range(LAYERS)
    ]
    build = {
        "kv_split": kvflow.KVLayout.from_kv_split_tensors,
        "blocks": kvflow.KVLayout.from_tensors,
        "mla": kvflow.KVLayout.from_mla_tensors,
    }[kind]
    return caches, build(caches, block_size=BS)


def _blocks(cache: torch.Tensor, kind: str, ids: list[int]) -> torch.Tensor:
    """The raw bytes of blocks ``ids`` (both halves of a kv_split cache)."""
    picked = cache[:, ids] if kind == "kv_split" else cache[ids]
    return picked.contiguous().view(torch.int16)


@pytest.fixture(params=["local", "shared"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    made: Store = (
        kvflow.LocalStore("256MiB") if request.param == "local" else ServedSharedStore(256 << 20)
    )
    yield made
    dispose(made)


@pytest.mark.parametrize("kind", KINDS)
def test_every_layout_round_trips_bit_exact(kind: str, store: Store) -> None:
    caches, layout = _caches(kind)
    cfg = kvflow.EngineConfig(chunk_blocks=4)
    tokens = np.arange(8 * BS)
    src, dst = list(range(8)), [40, 41, 42, 43, 20, 21, 22, 23]
    with kvflow.SyncTransferEngine(layout, store, cfg) as engine:
        assert isinstance(engine.engine.device, CudaDevice)
        torch.cuda.synchronize()
        assert engine.save(tokens, src).ok
        assert engine.load(tokens, dst).ok
    torch.cuda.synchronize()
    for cache in caches:
        assert torch.equal(_blocks(cache, kind, dst), _blocks(cache, kind, src))


def test_the_host_pools_are_pinned() -> None:
    local = kvflow.LocalStore("64MiB")
    shared = ServedSharedStore(64 << 20)
    try:
        assert local.pinned
        assert shared._conn is not None and shared._conn.pinned
    finally:
        local.close()
        dispose(shared)


def test_a_save_waits_for_the_compute_stream_that_wrote_the_layer(store: Store) -> None:
    caches, layout = _caches("blocks")
    cfg = kvflow.EngineConfig(chunk_blocks=4)
    tokens = np.arange(4 * BS)
    with kvflow.SyncTransferEngine(layout, store, cfg) as engine:
        torch.cuda.synchronize()
        save = engine.start_save([(tokens, [0, 1, 2, 3])])
        for layer, cache in enumerate(caches):
            torch.cuda._sleep(50_000_000)  # the compute stream is busy (tens of ms) ...
            cache[:4].fill_(layer + 1)  # ... before it writes the layer
            save.layer_written(layer, timeout=5)  # the host does not wait for it
        assert save.wait(timeout=30).ok
        assert engine.load(tokens, [8, 9, 10, 11]).ok
    torch.cuda.synchronize()
    for layer, cache in enumerate(caches):
        assert torch.all(cache[8:12] == layer + 1)


def test_a_load_orders_the_compute_stream_after_its_copy_without_blocking_the_host(
    store: Store,
) -> None:
    caches, layout = _caches("kv_split")
    device = CudaDevice("cuda")
    cfg = kvflow.EngineConfig(chunk_blocks=4)
    tokens = np.arange(4 * BS)
    with kvflow.SyncTransferEngine(layout, store, cfg, device=device) as engine:
        torch.cuda.synchronize()
        assert engine.save(tokens, [0, 1, 2, 3]).ok
        expected = [_blocks(c, "kv_split", [0, 1, 2, 3]).clone() for c in caches]
        for cache in caches:
            cache[:, 4:8].zero_()
        busy = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        busy.record()
        torch.cuda._sleep(400_000_000)  # queued work: the load must not write before it ends
        done.record()
        start = time.perf_counter()
        load = engine.start_load([(tokens, [4, 5, 6, 7])])
        load.wait_layer(0, timeout=30)  # returns once issued; the copy waits on the GPU
        returned = time.perf_counter() - start
        seen = [_blocks(caches[0], "kv_split", [4, 5, 6, 7])]  # the compute stream waits
        for layer in range(1, LAYERS):
            load.wait_layer(layer, timeout=30)
            seen.append(_blocks(caches[layer], "kv_split", [4, 5, 6, 7]))
        assert load.wait(timeout=30).ok
    torch.cuda.synchronize()
    assert returned < busy.elapsed_time(done) / 1e3 / 2  # the host did not wait for the GPU
    for got, want in zip(seen, expected, strict=True):
        assert torch.equal(got, want)


def test_the_engine_refuses_cuda_caches_on_a_store_that_cannot_copy_them() -> None:
    _, layout = _caches("blocks")
    from tests.support.pools import memcache_standin_store

    other = memcache_standin_store(1 << 20)
    try:
        with pytest.raises(kvflow.LayoutError, match="cuda"):
            kvflow.SyncTransferEngine(layout, other)
    finally:
        other.close()
