"""Requests named by chunk hashes made elsewhere (``ChunkHashes``), and an engine keyed by a
KeySpace of the caller's: what an inference server's scheduler and workers share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvflow
from kvflow.abc import Store
from kvflow.keys import KeySpace, chunk_hashes
from kvflow.stores.arena import slot_bytes
from kvflow.testing import InstrumentedStore
from tests.support.caches import make_caches
from tests.support.pools import dispose, make_store

BS, CHUNK = 16, 2


async def test_hashed_requests_reach_the_same_objects_as_token_requests() -> None:
    caches = make_caches(num_layers=3, num_blocks=32, seed=4)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = kvflow.LocalStore("16MiB")
    space = KeySpace.for_layout(
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


# -- preceding: the chunks before the ones a request moves ------------------------------------


@pytest.mark.parametrize("name", ["local", "shared"])
async def test_a_save_of_new_chunks_naming_the_preceding_ones_keeps_the_head(name: str) -> None:
    """Saved as an inference server saves a growing prompt: its head first, then only the new
    chunks, naming the head's hashes as ``preceding`` (no blocks for them). The pool (four
    chunks) then evicts the new tail before the head, and nothing is written for the head."""
    caches = make_caches(num_layers=2, num_blocks=32, seed=5)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = make_store(name, 4 * slot_bytes(layout.object_bytes(CHUNK)))
    tokens = np.random.default_rng(1).integers(0, 1000, 5 * CHUNK * BS)
    h = chunk_hashes(tokens, CHUNK * BS)
    config = kvflow.EngineConfig(chunk_blocks=CHUNK)
    try:
        async with kvflow.TransferEngine(layout, store, config) as engine:
            keys = engine.keyspace.keys(h)
            head = await engine.save(kvflow.ChunkHashes(tuple(h[:2])), np.arange(4))
            assert head.count(kvflow.ChunkStatus.OK) == 2
            tail = kvflow.ChunkHashes(tuple(h[2:4]), preceding=tuple(h[:2]))
            saved = await engine.save(tail, np.arange(4, 8))
            assert saved.count(kvflow.ChunkStatus.OK) == 2
            assert store.usage().objects == 4  # type: ignore[attr-defined]
            await engine.save(tokens[4 * CHUNK * BS :], np.arange(8, 10))  # another prompt
            assert store.lookup(keys[:4]).tolist() == [True, True, True, False]
            # a load of chunk 2 alone, naming chunks 0 and 1: the right bytes, head kept newest
            dst = np.arange(20, 22)
            for layer in caches:
                layer[dst] = 0
            loading = kvflow.ChunkHashes((h[2],), preceding=tuple(h[:2]))
            async with await engine.start_load([(loading, dst)]) as handle:
                assert (await handle.wait()).ok
            for layer in caches:
                assert torch.equal(layer[4:6].view(torch.uint8), layer[dst].view(torch.uint8))
    finally:
        dispose(store)


class _OwnPolicy(InstrumentedStore):
    """A counted LocalStore that, as a store evicting by its own policy (Mooncake, memcache),
    keeps ``Store``'s defaults for the context calls: the plain calls."""

    lookup_with_context = Store.lookup_with_context
    open_write_with_context = Store.open_write_with_context
    open_read_with_context = Store.open_read_with_context


async def test_a_store_without_context_gets_the_moved_chunks_only() -> None:
    """A store that evicts by its own policy is called with the moved chunks alone: the
    preceding chunks are neither sent nor moved."""
    caches = make_caches(num_layers=2, num_blocks=16, seed=6)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = _OwnPolicy(kvflow.LocalStore("4MiB"))
    tokens = np.random.default_rng(2).integers(0, 1000, 3 * CHUNK * BS)
    h = chunk_hashes(tokens, CHUNK * BS)
    try:
        async with kvflow.TransferEngine(
            layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)
        ) as engine:
            tail = kvflow.ChunkHashes((h[2],), preceding=tuple(h[:2]))
            assert (await engine.save(tail, np.arange(2))).ok
            assert store.keys["open_write"] == 1
            assert store.lookup(engine.keyspace.keys(h)).tolist() == [False, False, True]
    finally:
        store.close()


def test_preceding_hashes_are_refused_naming_the_bad_one() -> None:
    with pytest.raises(kvflow.InvalidArgumentError, match=r"preceding\[1\]"):
        kvflow.ChunkHashes((b"c",), preceding=(b"a", b""))
    with pytest.raises(kvflow.InvalidArgumentError, match=r"preceding\[0\]"):
        kvflow.ChunkHashes((b"c",), preceding=("a",))  # type: ignore[arg-type]
