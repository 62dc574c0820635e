"""Fixtures for the memcache tests: the in-memory stand-in for memcache's client (no Ascend
hardware here; see ``standin.py``), a MemcacheStore over it, and KV caches to move."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvflow
from kvflow.keys import chunk_hashes
from tests.conftest import make_caches
from tests.memcache.standin import MemcacheStandIn
from tests.pools import memcache_standin_store

BS = 16  # tokens per block
CHUNK = 2  # blocks per chunk (one pool object per chunk)


@pytest.fixture
def standin() -> MemcacheStandIn:
    return MemcacheStandIn(16 << 20)


@pytest.fixture
def store(standin: MemcacheStandIn) -> Iterator[kvflow.MemcacheStore]:
    s = memcache_standin_store(0, client=standin)
    yield s
    s.close()


def layout_of(layers: int, blocks: int = 32) -> tuple[list[torch.Tensor], kvflow.KVLayout]:
    """Caches of ``layers`` layers, ``blocks`` blocks of 32 random bytes each, and their layout."""
    caches = make_caches(layers, num_blocks=blocks, block_shape=(32,), dtype=torch.uint8)
    return caches, kvflow.KVLayout.from_tensors(caches, block_size=BS)


def tokens(chunks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK * BS)


def chunk_keys(engine: kvflow.SyncTransferEngine, token_ids: np.ndarray) -> list[str]:
    """The store keys of a request's chunks, as the engine names them."""
    hashes = chunk_hashes(token_ids, CHUNK * BS)
    return engine.engine.keyspace.keys(hashes)


def same_blocks(caches: list[torch.Tensor], a: np.ndarray, b: np.ndarray) -> bool:
    return all(torch.equal(c[a], c[b]) for c in caches)
