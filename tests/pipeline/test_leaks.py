"""After thousands of operations, slots, leases, tasks and threads are back to baseline."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

import kvflow
from tests.support.pools import ARENA_STORE_NAMES, dispose, make_store
from tests.support.waits import wait_until_async

BS = 4


@pytest.mark.parametrize("store_name", ARENA_STORE_NAMES)
async def test_thousands_of_operations_leak_nothing(store_name: str) -> None:
    threads_before = threading.active_count()
    caches = [torch.zeros(64, 16, dtype=torch.uint8) for _ in range(4)]
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = make_store(store_name, 16 * 4096)
    rng = np.random.default_rng(1)
    engine = kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2))
    tasks_before = len(asyncio.all_tasks())
    prompts = [rng.integers(0, 5, 16) for _ in range(40)]  # reused: hits and evictions both
    for i in range(1500):
        tokens = prompts[rng.integers(0, len(prompts))]
        blocks = rng.permutation(64)[:4]
        if i % 3 == 0:
            await engine.save(tokens, blocks)
        elif i % 3 == 1:
            hit = await engine.lookup(tokens)
            await engine.load(tokens[:hit], blocks[: hit // BS])
        else:  # abandoned layerwise handles
            handle = await engine.start_load([(tokens, blocks)])
            await handle.wait_layer(0)
            await handle.aclose()
    await wait_until_async(
        lambda: not engine._runtime.batches and not engine._runtime.tasks, 60, "no open batch"
    )
    usage = store.usage()
    assert (usage.leases, usage.pending_writes, usage.open_sessions) == (0, 0, 0)
    assert usage.objects > 0 and usage.used == usage.objects * layout.object_bytes(2)
    assert usage.hits > 100 and usage.evictions > 100
    assert not engine._runtime.batches
    assert len(asyncio.all_tasks()) == tasks_before
    assert engine._runtime.copier.in_flight == 0
    await engine.close()
    dispose(store)
    await wait_until_async(
        lambda: threading.active_count() <= threads_before, 60, "the engine's threads to end"
    )
