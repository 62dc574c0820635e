"""Planning a request batch: pure validation and keying, before any store call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.errors import InvalidArgumentError
from kvflow.keys import ChunkHashes, KeySpace, chunk_hashes, token_array
from kvflow.layout import KVLayout
from kvflow.results import RequestResult, TransferResult

__all__ = ["BatchPlan", "plan_batch"]


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """The full chunks of a batch of requests, in request order.

    ``keys[c]`` is chunk c's store key and ``block_ids[c*C:(c+1)*C]`` its device blocks;
    ``chunks_per_request[r]`` says how many chunks request r contributed.
    """

    keys: tuple[str, ...]
    block_ids: np.ndarray
    chunks_per_request: tuple[int, ...]
    chunk_blocks: int
    block_size: int

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    def chunk_block_ids(self, chunks: np.ndarray) -> np.ndarray:
        """Device blocks of the given chunk indices, concatenated in that order."""
        blocks: np.ndarray = self.block_ids.reshape(-1, self.chunk_blocks)[chunks].reshape(-1)
        return blocks

    def result(self, status: np.ndarray) -> TransferResult:
        """Split per-chunk statuses into one RequestResult per request."""
        out = []
        start = 0
        for n in self.chunks_per_request:
            blocks = self.block_ids[start * self.chunk_blocks : (start + n) * self.chunk_blocks]
            out.append(
                RequestResult(
                    block_ids=blocks,
                    chunk_status=status[start : start + n].copy(),
                    chunk_blocks=self.chunk_blocks,
                    block_size=self.block_size,
                )
            )
            start += n
        return TransferResult(tuple(out))


def plan_batch(
    layout: KVLayout,
    keyspace: KeySpace,
    requests: Any,
    chunk_blocks: int,
    *,
    load: bool,
) -> BatchPlan:
    """Validate ``[(token_ids, block_ids), ...]`` and key their full chunks.

    Each request needs exactly ``ceil(len(token_ids) / block_size)`` block ids; a request named
    by ``ChunkHashes`` needs ``chunk_blocks`` ids per chunk. For a load, no
    device block may receive two chunks. Raises InvalidArgumentError before anything is changed.
    """
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise InvalidArgumentError(
            "requests", requests, "expected a list of (token_ids, block_ids)"
        )
    chunk_tokens = chunk_blocks * layout.block_size
    keys: list[str] = []
    blocks: list[np.ndarray] = []
    counts: list[int] = []
    for r, request in enumerate(requests):
        if not isinstance(request, (tuple, list)) or len(request) != 2:
            raise InvalidArgumentError(
                f"requests[{r}]", request, "expected a (token_ids, block_ids) pair"
            )
        ids = layout.check_block_ids(request[1], argument=f"requests[{r}].block_ids")
        if isinstance(request[0], ChunkHashes):
            hashes, need = list(request[0].hashes), len(request[0]) * chunk_blocks
            what = f"{len(hashes)} chunks of {chunk_blocks} blocks need {need} blocks"
        else:
            tokens = token_array(request[0], argument=f"requests[{r}].token_ids")
            hashes = chunk_hashes(tokens, chunk_tokens)
            need = -(-tokens.shape[0] // layout.block_size)
            what = f"{tokens.shape[0]} tokens at block_size={layout.block_size} need {need} blocks"
        if ids.shape[0] != need:
            raise InvalidArgumentError(f"requests[{r}].block_ids", f"{ids.shape[0]} blocks", what)
        n = len(hashes)
        keys.extend(keyspace.keys(hashes))
        blocks.append(ids[: n * chunk_blocks])
        counts.append(n)
    block_ids = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
    if load and block_ids.size != np.unique(block_ids).size:
        values, seen = np.unique(block_ids, return_counts=True)
        raise InvalidArgumentError(
            "block_ids", int(values[seen > 1][0]), "a load would write two chunks into this block"
        )
    return BatchPlan(tuple(keys), block_ids, tuple(counts), chunk_blocks, layout.block_size)
