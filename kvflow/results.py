"""Results of transfers: which chunks, and so which blocks, succeeded. Failure is data."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from kvflow.layout import SKIP_BLOCK

__all__ = ["ChunkStatus", "RequestResult", "TransferResult"]


class ChunkStatus(enum.IntEnum):
    """What happened to one chunk of a request."""

    OK = 0  # every layer moved
    FAILED = 1  # a copy failed or timed out, or the store failed: treat every block as lost
    MISSING = 2  # load: not in the pool (never stored, or evicted since the lookup)
    EXISTS = 3  # save: already stored, or being stored by someone else; nothing to do
    NO_SPACE = 4  # save: no room in the pool, skipped


@dataclass(frozen=True, eq=False)
class RequestResult:
    """One request's outcome. ``block_ids`` are the blocks of its full chunks, in order (a
    load's ``SKIP_BLOCK`` places among them, which no ``*_block_ids`` property lists)."""

    block_ids: np.ndarray
    chunk_status: np.ndarray
    chunk_blocks: int
    block_size: int

    def blocks_with(self, *statuses: ChunkStatus) -> np.ndarray:
        """Block ids of the chunks whose status is one of ``statuses``."""
        mask = np.isin(self.chunk_status, [int(s) for s in statuses])
        blocks = self.block_ids.reshape(-1, self.chunk_blocks)[mask].reshape(-1)
        written: np.ndarray = blocks[blocks != SKIP_BLOCK]  # nothing was written at a skip
        return written

    @property
    def ok_block_ids(self) -> np.ndarray:
        return self.blocks_with(ChunkStatus.OK)

    @property
    def failed_block_ids(self) -> np.ndarray:
        """Blocks whose KV must not be used (load) or was not stored (save) through a failure.

        For a load this includes MISSING chunks: the caller must recompute those blocks.
        """
        return self.blocks_with(ChunkStatus.FAILED, ChunkStatus.MISSING)

    @property
    def ok_tokens(self) -> int:
        """Tokens covered by the leading run of OK (or, for saves, already stored) chunks."""
        good = np.isin(self.chunk_status, [ChunkStatus.OK, ChunkStatus.EXISTS])
        bad = np.flatnonzero(~good)
        leading = int(bad[0]) if bad.size else int(good.size)
        return leading * self.chunk_blocks * self.block_size

    def count(self, status: ChunkStatus) -> int:
        return int(np.count_nonzero(self.chunk_status == status))


@dataclass(frozen=True, eq=False)
class TransferResult:
    """The outcome of a save or load of a request batch: one RequestResult per request."""

    requests: tuple[RequestResult, ...]

    @property
    def ok(self) -> bool:
        """No chunk failed or went missing (EXISTS and NO_SPACE are not failures)."""
        return all(r.failed_block_ids.size == 0 for r in self.requests)

    @property
    def failed_block_ids(self) -> np.ndarray:
        parts = [r.failed_block_ids for r in self.requests]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def count(self, status: ChunkStatus) -> int:
        return sum(r.count(status) for r in self.requests)

    def __repr__(self) -> str:
        counts = {s.name: self.count(s) for s in ChunkStatus if self.count(s)}
        return f"TransferResult(requests={len(self.requests)}, chunks={counts})"
