"""Two processes on one real Mooncake master: one saves into its own segment, another (a pure
client, no segment) finds and loads every chunk, byte for byte."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path

import numpy as np

import kvflow
from kvflow import ChunkStatus
from tests.support.mooncake_workers import engine_config, store_for
from tests.support.pool_workers import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    LAYERS,
    NUM_BLOCKS,
    NUM_PROMPTS,
    check,
    make_caches,
    prompts,
)
from tests.support.pools import MooncakeMaster, mooncake_master
from tests.support.processes import Workers


def poison(caches: list, blocks: np.ndarray) -> None:
    for layer in caches:
        layer.numpy().reshape(NUM_BLOCKS, -1)[blocks] = 0xEE


async def test_pure_client_loads_what_another_process_saved(
    workers: Workers, tmp_path: Path
) -> None:
    master = mooncake_master()
    prefix = f"xproc{os.getpid()}-{time.monotonic_ns()}/"
    release = str(tmp_path / "release")
    saver = workers(
        "saver", "save_and_hold", master=master.address, prefix=prefix,
        prompts=list(range(NUM_PROMPTS)), release=release,
    )  # fmt: skip
    saved = saver.wait_ready(90)["status"]
    for status in saved:  # shared prefixes were stored once, by the first prompt that had them
        assert set(status) <= {ChunkStatus.OK, ChunkStatus.EXISTS}, saved

    client = store_for({"master": master.address, "prefix": prefix}, 0)  # a pure client
    caches = make_caches()
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    try:
        async with kvflow.TransferEngine(layout, client, engine_config()) as engine:
            every = prompts()
            for tokens in every:
                assert await engine.lookup(tokens) == len(tokens)
            for i, tokens in enumerate(every):
                blocks = np.arange(len(tokens) // BLOCK_SIZE) + 40
                poison(caches, blocks)
                before = client.stats()
                result = await asyncio.wait_for(engine.load(tokens, blocks), 60)
                after = client.stats()
                assert result.ok, (i, result)
                for c in range(len(tokens) // CHUNK_TOKENS):
                    assert check(caches, tokens, blocks, c), (i, c)
                # one get session per batch, whatever the layer count: start and end
                assert after.master_calls - before.master_calls == 2
                assert after.copy_calls - before.copy_calls == LAYERS
            assert client.stats().open_sessions == 0
    finally:
        client.close()
        await asyncio.to_thread(Path(release).touch)
    assert saver.result(60)["status"] == saved


async def test_a_pure_client_cannot_save_without_segments(own_master: MooncakeMaster) -> None:
    """A master with no segment mounted: saves are skipped for want of space, and counted."""
    client = store_for({"master": own_master.address, "prefix": "nospace/"}, 0)
    caches = make_caches()
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    config = dataclasses.replace(engine_config(), op_timeout_s=5)
    try:
        async with kvflow.TransferEngine(layout, client, config) as engine:
            tokens = prompts()[0]
            result = await asyncio.wait_for(engine.save(tokens, np.arange(4)), 60)
            assert result.count(ChunkStatus.NO_SPACE) == len(tokens) // CHUNK_TOKENS
            assert client.stats().no_space == len(tokens) // CHUNK_TOKENS
            assert await engine.lookup(tokens) == 0
    finally:
        client.close()
