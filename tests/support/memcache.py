"""Helpers for the memcache tests: small KV caches and their layout, prompts of whole chunks,
the store keys the engine gives a prompt's chunks, and block comparisons."""

from __future__ import annotations

import numpy as np
import torch

import kvflow
from kvflow.keys import chunk_hashes
from tests.support.caches import make_caches

__all__ = ["BS", "CHUNK", "chunk_keys", "layout_of", "same_blocks", "tokens"]

BS = 16  # tokens per block
CHUNK = 2  # blocks per chunk (one pool object per chunk)


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
