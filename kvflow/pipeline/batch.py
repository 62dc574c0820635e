"""Planning a request batch: pure validation and keying, before any store call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvflow._validate import repeated
from kvflow.errors import InvalidArgumentError
from kvflow.keys import ChunkHashes, KeySpace, chunk_hashes, token_array
from kvflow.layout import SKIP_BLOCK, KVLayout
from kvflow.results import RequestResult, TransferResult

__all__ = ["BatchPlan", "BlockRequest", "check_distinct_blocks", "plan_batch"]


class BlockRequest(NamedTuple):
    """One request of a batch: its tokens and the device blocks that hold (or will hold) them.

    ``token_ids``: the prompt's token ids (a sequence or 1-d array of ints), or ``ChunkHashes``.
    ``block_ids``: one device block id per ``block_size`` tokens (per chunk of ``ChunkHashes``,
    ``chunk_blocks`` ids); a load may name ``SKIP_BLOCK``. A plain ``(token_ids, block_ids)``
    tuple is accepted wherever a BlockRequest is.
    """

    token_ids: Any
    block_ids: Any


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """The full chunks of a batch of requests, in request order.

    ``keys[c]`` is chunk c's store key and ``block_ids[c*C:(c+1)*C]`` its device blocks (a
    load's ``SKIP_BLOCK`` places are not written); ``chunks_per_request[r]`` says how many
    chunks request r contributed. ``context``: the keys of the chunks before the moved ones
    (``ChunkHashes.preceding``), request by request, for a store that orders eviction by prefix
    (the prefix context of ``kvflow.stores.base``); never moved.
    """

    keys: tuple[str, ...]
    block_ids: np.ndarray
    chunks_per_request: tuple[int, ...]
    chunk_blocks: int
    block_size: int
    context: tuple[str, ...] = ()

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    def moved_blocks(self, chunks: np.ndarray) -> int:
        """How many device blocks the given chunk indices move (their places but SKIP_BLOCK)."""
        return int(np.count_nonzero(self.chunk_block_ids(chunks) != SKIP_BLOCK))

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
    """Validate ``[BlockRequest(token_ids, block_ids), ...]`` (or plain pairs) and key their
    full chunks.

    Each request needs exactly ``ceil(len(token_ids) / block_size)`` block ids; a request named
    by ``ChunkHashes`` needs ``chunk_blocks`` ids per chunk. A load may name ``SKIP_BLOCK`` for
    places whose KV the caller holds already (vLLM's own prefix cache ending inside a chunk):
    nothing is written there, and a failed chunk reports only its other blocks. The blocks a
    request moves (those of its full chunks) must be distinct (``check_distinct_blocks``).
    Raises InvalidArgumentError before anything is changed.
    """
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise InvalidArgumentError(
            "requests", requests, "expected a list of (token_ids, block_ids)"
        )
    chunk_tokens = chunk_blocks * layout.block_size
    keys: list[str] = []
    context: list[str] = []
    blocks: list[np.ndarray] = []
    counts: list[int] = []
    for r, request in enumerate(requests):
        if not isinstance(request, (tuple, list)) or len(request) != 2:
            raise InvalidArgumentError(
                f"requests[{r}]", request, "expected a (token_ids, block_ids) pair"
            )
        ids = layout.check_block_ids(request[1], argument=f"requests[{r}].block_ids", skip=load)
        if isinstance(request[0], ChunkHashes):
            hashes, need = list(request[0].hashes), len(request[0]) * chunk_blocks
            what = f"{len(hashes)} chunks of {chunk_blocks} blocks need {need} blocks"
            if hashes:  # a request that moves nothing has nothing to order
                context.extend(keyspace.keys(request[0].preceding))
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
    check_distinct_blocks(blocks, load=load)
    block_ids = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
    return BatchPlan(
        tuple(keys), block_ids, tuple(counts), chunk_blocks, layout.block_size, tuple(context)
    )


def check_distinct_blocks(blocks: Sequence[np.ndarray], *, load: bool) -> None:
    """Refuse a batch whose ``blocks[r]`` (the blocks request r moves) name a block twice.

    Within one request a block cannot be two places of one sequence: a save would store one
    block's KV for both, a load would write two chunks into it. Between requests a load is
    refused alike; a save is not, since requests with a common prefix share its blocks. The
    null block (id 0) that a sliding window's block table repeats is refused too: the places it
    stands for hold no KV. InvalidArgumentError names ``requests[r].block_ids`` and the repeated
    ids.
    """
    blocks = [b[b != SKIP_BLOCK] for b in blocks]  # a load's places it does not write
    if len(blocks) == 0:
        return
    every = np.concatenate(blocks)
    n = len(blocks)  # one sort finds both: block-major, request-minor tags
    tags = np.sort(every * n + np.repeat(np.arange(n), [b.size for b in blocks]))
    same_request = tags[1:] == tags[:-1]
    same_block = (tags[1:] // n == tags[:-1] // n) if load else same_request
    if not same_block.any():
        return
    if load:
        moved = "a load would write two chunks into one block"
    else:
        moved = "a save would store one block's KV for two places of the sequence"
    if same_request.any():
        r = int((tags[1:][same_request] % n).min())
        raise InvalidArgumentError(
            f"requests[{r}].block_ids",
            repeated(blocks[r]),
            f"repeated among the blocks of the request's full chunks: {moved}",
        )
    for r in range(1, n):  # a load: the first request that reuses an earlier one's block
        for q in range(r):
            shared = np.intersect1d(blocks[q], blocks[r])
            if shared.size:
                raise InvalidArgumentError(
                    f"requests[{r}].block_ids",
                    [int(b) for b in shared],
                    f"also among the blocks requests[{q}] loads: {moved}",
                )
