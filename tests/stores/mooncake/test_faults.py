"""Faults of a real Mooncake deployment: the master killed during a layerwise load, the master
restarted, the pool full, a master answering session starts after they timed out. Nothing
hangs, nothing partly loaded is reported loaded, nothing stored is corrupted, and service
resumes without restarting the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvflow
from kvflow import ChunkStatus, MooncakeMaster
from tests.support.caches import make_caches as random_caches
from tests.support.mooncake_workers import engine_config, store_for
from tests.support.pool_workers import BLOCK_SIZE, CHUNK_TOKENS, make_caches, prompts
from tests.support.processes import Workers
from tests.support.waits import wait_until


async def test_master_and_owner_killed_during_a_layerwise_load(
    own_master: MooncakeMaster, workers: Workers, tmp_path: Path
) -> None:
    """The master dies, and so does the process whose segment holds the bytes, after layer 0
    arrived: the layers still to come cannot be read, so every chunk fails (none is reported
    loaded with a layer missing), within the copy timeout, and the sessions end."""
    prefix = f"kill{os.getpid()}/"
    address = own_master.address
    saver = workers(
        "saver", "save_and_hold", master=address, prefix=prefix, prompts=[3, 4, 5],
        release=str(tmp_path / "never"),
    )  # fmt: skip
    saver.wait_ready(90)
    client = store_for({"master": address, "prefix": prefix}, 0)
    caches = make_caches()
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    config = dataclasses.replace(engine_config(), prefetch_layers=1, copy_timeout_s=3)
    tokens = prompts()[5]
    blocks = np.arange(len(tokens) // BLOCK_SIZE) + 32
    try:
        async with kvflow.TransferEngine(layout, client, config) as engine:
            assert await engine.lookup(tokens) == len(tokens)
            async with await engine.start_load([(tokens, blocks)]) as handle:
                await handle.wait_layer(0, timeout=60)
                own_master.kill()
                saver.kill()
                # what holds the copies is Mooncake's own retrying (no gate of the test's): the
                # bound is a deadline on the wait, 10x the copy timeout and >= 30 s, far above
                # a stall, far below Mooncake's retries
                bound = max(30, 10 * config.copy_timeout_s)
                result = await asyncio.wait_for(handle.wait(timeout=bound), bound)
            status = result.requests[0].chunk_status
            assert (status == ChunkStatus.FAILED).all(), result
            # the session ends once the copies that ran past their timeout return
            await _until(lambda: client.stats().open_sessions == 0, 60, "the read session to end")

            # with the master away: lookups miss and saves are skipped, and counted; bounded
            # by the store's timeout_s (a deadline as above: 10x it, and >= 30 s)
            bound = max(30, 10 * client.config.timeout_s)
            assert await asyncio.wait_for(engine.lookup(tokens), bound) == 0
            saved = await asyncio.wait_for(engine.save(tokens, blocks), bound)
            assert saved.count(ChunkStatus.OK) == 0
            stats = engine.stats()
            assert stats.lookup_errors >= 1 and stats.store_errors >= 1
            assert client.stats().unavailable >= 2
    finally:
        client.close()


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.05)


def _fill(caches: list[torch.Tensor], blocks: np.ndarray, seed: int) -> list[np.ndarray]:
    """Random bytes into ``blocks`` of every layer; returns them, to compare a load with."""
    gen = np.random.default_rng(seed)
    want = []
    for layer in caches:
        raw = layer.view(torch.uint8).numpy().reshape(layer.shape[0], -1)
        raw[blocks] = gen.integers(0, 256, raw[blocks].shape, dtype=np.uint8)
        want.append(raw[blocks].copy())
    return want


def _loaded_exactly(caches: list[torch.Tensor], blocks: np.ndarray, want: list[np.ndarray]) -> bool:
    for layer, expected in zip(caches, want, strict=True):
        raw = layer.view(torch.uint8).numpy().reshape(layer.shape[0], -1)
        if not np.array_equal(raw[blocks], expected):
            return False
    return True


def _tokens(chunks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK_TOKENS)


async def test_master_restarted_service_resumes(own_master: MooncakeMaster) -> None:
    caches = random_caches(num_layers=4, num_blocks=64, block_shape=(BLOCK_SIZE, 64), seed=5)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    store = store_for({"master": own_master.address, "prefix": "restart/"}, "32MiB")
    config = dataclasses.replace(engine_config(), op_timeout_s=8)
    src, dst = np.arange(0, 8), np.arange(8, 16)
    try:
        async with kvflow.TransferEngine(layout, store, config) as engine:
            tokens = _tokens(4, seed=1)
            want = _fill(caches, src, seed=1)
            assert (await asyncio.wait_for(engine.save(tokens, src), 60)).ok

            own_master.kill()
            assert await engine.lookup(tokens) == 0
            other = _tokens(2, seed=2)
            skipped = await asyncio.wait_for(engine.save(other, np.arange(16, 20)), 60)
            assert skipped.count(ChunkStatus.OK) == 0
            assert store.stats().unavailable >= 2

            own_master.start()  # the same address; its metadata starts empty

            def resumed() -> bool:
                try:
                    return not store.lookup(["probe"]).any()
                except kvflow.StoreUnavailableError:
                    return False

            wait_until(resumed, 60, "the Mooncake client to reach the restarted master", 0.2)

            async def save_until_stored() -> kvflow.TransferResult:
                deadline = time.monotonic() + 60  # the client remounts its segment shortly
                while True:
                    result = await asyncio.wait_for(engine.save(tokens, src), 60)
                    stored = result.count(ChunkStatus.OK) == len(src) // 2
                    if stored or time.monotonic() > deadline:
                        return result
                    await asyncio.sleep(0.5)

            again = await save_until_stored()
            assert again.count(ChunkStatus.OK) == 4
            assert await engine.lookup(tokens) == len(tokens)
            loaded = await asyncio.wait_for(engine.load(tokens, dst), 60)
            assert loaded.ok and loaded.count(ChunkStatus.OK) == 4
            assert _loaded_exactly(caches, dst, want)
            assert store.stats().open_sessions == 0
    finally:
        store.close()


async def test_pool_full_skips_saves_and_corrupts_nothing(own_master: MooncakeMaster) -> None:
    """96 objects of 512 KiB into a 16 MiB segment: the pool fills, the master evicts, and a
    save that finds no space is skipped (counted). Whether a put finds the segment full or
    the master's eviction made room first is a race, so the pool's filling shows as skipped
    saves, chunks missing at load, or both; every chunk still stored loads exactly."""
    caches = random_caches(num_layers=4, num_blocks=64, block_shape=(BLOCK_SIZE, 4096), seed=7)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    store = store_for({"master": own_master.address, "prefix": "full/"}, "16MiB")
    wanted: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
    try:
        async with kvflow.TransferEngine(layout, store, engine_config()) as engine:
            statuses = []
            for i in range(24):
                tokens, blocks = _tokens(4, seed=100 + i), np.arange(8) + 8 * (i % 8)
                wanted[i] = (tokens, _fill(caches, blocks, seed=100 + i))
                result = await asyncio.wait_for(engine.save(tokens, blocks), 60)
                statuses.extend(result.requests[0].chunk_status.tolist())
            assert set(statuses) <= {ChunkStatus.OK, ChunkStatus.NO_SPACE}, statuses
            skipped = statuses.count(ChunkStatus.NO_SPACE)
            assert store.stats().no_space == skipped

            loaded_chunks = missing_chunks = 0
            for tokens, want in wanted.values():
                blocks = np.arange(48, 56)
                for layer in caches:
                    layer.view(torch.uint8)[blocks] = 0xEE
                result = await asyncio.wait_for(engine.load(tokens, blocks), 60)
                status = result.requests[0].chunk_status
                assert set(status.tolist()) <= {ChunkStatus.OK, ChunkStatus.MISSING}
                missing_chunks += int(np.count_nonzero(status == ChunkStatus.MISSING))
                for c in np.flatnonzero(status == ChunkStatus.OK):
                    here = blocks[2 * c : 2 * c + 2]
                    part = [w[2 * c : 2 * c + 2] for w in want]
                    assert _loaded_exactly(caches, here, part), c
                    loaded_chunks += 1
            assert loaded_chunks > 0
            # 48 MiB cannot all be in 16 MiB: some saves were skipped or some chunks evicted
            assert skipped + missing_chunks > 0, "the pool never filled"
            assert store.stats().open_sessions == 0
    finally:
        store.close()


class _SlowStarts:
    """The real Mooncake client, but its session starts named in ``held`` wait for ``go``
    first: a master that answers late, as one coming back from a restart answers the client's
    retries of calls kvflow gave up on. Every call made through it is noted (name, keys)."""

    def __init__(self, client: Any, held: set[str]) -> None:
        self._client, self.held = client, held
        self.go = threading.Event()
        self.calls: list[tuple[str, list[str]]] = []

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._client, name)
        if not name.startswith("batch_"):
            return call

        def noted(keys: list[str], *args: Any) -> Any:
            self.calls.append((name, list(keys)))
            if name in self.held:
                assert self.go.wait(60), "the test never let the held call go"
            return call(keys, *args)

        return noted


async def test_sessions_a_late_answer_started_are_ended(own_master: MooncakeMaster) -> None:
    """A save and a load whose session starts time out here, and reach the master afterwards:
    the sessions they started there are ended before the next start, so the prefix can be
    saved again (an open put session would make the master refuse it for good) and loads
    bit-exact."""
    caches = random_caches(num_layers=4, num_blocks=64, block_shape=(BLOCK_SIZE, 64), seed=9)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    store = kvflow.MooncakeStore(
        master_server_address=own_master.address, local_hostname="127.0.0.1",
        global_segment_size="16MiB", key_prefix="late/", timeout_s=0.5,
    )  # fmt: skip
    real = store.client
    tokens, src, dst = _tokens(4, seed=3), np.arange(0, 8), np.arange(8, 16)
    want = _fill(caches, src, seed=3)
    try:
        async with kvflow.TransferEngine(layout, store, engine_config()) as engine:
            slow = _SlowStarts(real, {"batch_put_session_start"})
            store._client = slow
            skipped = await asyncio.wait_for(engine.save(tokens, src), 60)
            assert skipped.count(ChunkStatus.OK) == 0  # timed out: nothing saved, says so
            slow.go.set()  # the master answers now: four put sessions nobody will finish
            await _until(lambda: store.stats().late_sessions == 4, 30, "the late answer")
            saved = await asyncio.wait_for(engine.save(tokens, src), 60)
            assert saved.count(ChunkStatus.OK) == 4, saved
            revoked = [keys for name, keys in slow.calls if name == "batch_put_session_revoke"]
            assert len(revoked) == 1 and len(revoked[0]) == 4  # before the second start
            assert await engine.lookup(tokens) == len(tokens)

            slow = _SlowStarts(real, {"batch_get_session_start"})
            store._client = slow
            failed = await asyncio.wait_for(engine.load(tokens, dst), 60)
            assert failed.count(ChunkStatus.OK) == 0
            slow.go.set()  # four get sessions, each holding a lease, nobody reading
            await _until(lambda: store.stats().late_sessions == 8, 30, "the late answer")
            loaded = await asyncio.wait_for(engine.load(tokens, dst), 60)
            assert loaded.count(ChunkStatus.OK) == 4 and _loaded_exactly(caches, dst, want)
            names = [name for name, _ in slow.calls]
            ended = names.index("batch_get_session_end")  # the late ones, before the start
            assert ended < len(names) - 1 - names[::-1].index("batch_get_session_start")
            assert store.stats().open_sessions == 0
    finally:
        store.close()
