"""Requests named by chunk hashes made elsewhere (``ChunkHashes``), and an engine keyed by a
KeySpace of the caller's: what an inference server's scheduler and workers share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvflow
from kvflow.keys import chunk_hashes
from tests.conftest import make_caches

BS, CHUNK = 16, 2


async def test_hashed_requests_reach_the_same_objects_as_token_requests() -> None:
    caches = make_caches(num_layers=3, num_blocks=32, seed=4)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = kvflow.LocalStore("16MiB")
    space = kvflow.KeySpace.for_layout(
        model="m", layout_fingerprint="spec-1", chunk_blocks=CHUNK, num_layers=3, rank=0
    )
    config = kvflow.EngineConfig(chunk_blocks=CHUNK)
    tokens = np.random.default_rng(0).integers(0, 1000, 3 * CHUNK * BS + 5)
    hashes = kvflow.ChunkHashes(tuple(chunk_hashes(tokens, CHUNK * BS)))
    async with kvflow.TransferEngine(layout, store, config, keyspace=space) as engine:
        assert engine.keyspace is space
        saved = await engine.save(tokens, np.arange(7))  # 3 full chunks + a partial block
        assert saved.count(kvflow.ChunkStatus.OK) == 3
        assert store.lookup(space.keys(list(hashes.hashes))).all()
        dst = np.arange(16, 22)
        for layer in caches:
            layer[dst] = 0
        async with await engine.start_load([(hashes, dst)]) as handle:
            result = await handle.wait()
        assert result.ok and result.count(kvflow.ChunkStatus.OK) == 3
        for layer in caches:
            assert torch.equal(layer[np.arange(6)].view(torch.uint8), layer[dst].view(torch.uint8))
        with pytest.raises(kvflow.InvalidArgumentError, match="3 chunks of 2 blocks need 6"):
            await engine.start_load([(hashes, dst[:5])])
    store.close()


def test_chunk_hashes_refuse_what_is_not_bytes() -> None:
    with pytest.raises(kvflow.InvalidArgumentError, match=r"hashes\[1\]"):
        kvflow.ChunkHashes((b"a", "b"))  # type: ignore[arg-type]
    with pytest.raises(kvflow.InvalidArgumentError, match=r"hashes\[0\]"):
        kvflow.ChunkHashes((b"",))
