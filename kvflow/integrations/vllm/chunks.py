"""ChunkGrid: where a request's chunks, blocks and sliding window fall (pure arithmetic).

A chunk is ``chunk_blocks`` vLLM blocks of ``block_size`` tokens; its key is its last block's
hash (vLLM's block hashes are prefix-chained, so that hash names the whole prefix). With
sliding-window attention (``window``: the tokens whose blocks vLLM keeps behind a position, its
own included), vLLM keeps only the blocks the next token's window reads and puts its null block
(``NULL_BLOCK``) in the block table for the others; a hit ending at chunk ``E`` then needs only
the chunks that hold a block of the window before ``E``. No state, no I/O: the planner
(``planner.py``) asks these questions of its grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["NULL_BLOCK", "ChunkGrid"]

NULL_BLOCK = 0  # the id of vLLM's null block (its BlockPool's first), for blocks a window dropped


@dataclass(frozen=True)
class ChunkGrid:
    """Chunks of ``chunk_blocks`` blocks of ``block_size`` tokens; ``window``: sliding-window
    attention's kept tokens (0: full attention)."""

    block_size: int
    chunk_blocks: int
    window: int = 0

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.chunk_blocks

    def chunk_hashes(
        self, block_hashes: Sequence[bytes], first: int, end: int
    ) -> tuple[bytes, ...]:
        """The keys of chunks ``[first, end)``: each one's last block hash."""
        return tuple(self.chunk_hash(block_hashes, c) for c in range(first, end))

    def chunk_hash(self, block_hashes: Sequence[bytes], chunk: int) -> bytes:
        return bytes(block_hashes[(chunk + 1) * self.chunk_blocks - 1])

    def dropped_blocks(self, computed: int) -> int:
        """The blocks before the window of the token after the first ``computed``: vLLM keeps
        none of them (its ``get_num_skipped_tokens``), so they are neither loaded nor saved."""
        return max(0, computed - self.window + 1) // self.block_size if self.window else 0

    def window_chunk(self, end: int) -> int:
        """The first chunk a hit ending at chunk ``end`` needs: it holds the window's first
        block."""
        return self.dropped_blocks(end * self.chunk_tokens) // self.chunk_blocks

    def hit_end(self, found: np.ndarray, first: int, limit: int | None = None) -> int:
        """The last chunk end ``E`` in ``(first, first + len(found)]`` (and at most ``limit``)
        such that every chunk from ``max(first, window chunk of E)`` to ``E`` was found
        (``found[i]``: chunk ``first + i``); ``first`` when there is none."""
        if limit is not None:
            found = found[: max(0, limit - first)]
        misses = np.flatnonzero(~found)
        if not self.window or not misses.size:  # the leading run of found chunks, in NumPy
            return first + (int(misses[0]) if misses.size else int(found.size))
        runs: list[int] = []  # runs[i]: found chunks in a row, ending at chunk ``first + i``
        for f in found.tolist():
            runs.append(runs[-1] + 1 if f and runs else int(f))
        for end in range(first + len(runs), first, -1):
            if runs[end - first - 1] >= end - max(first, self.window_chunk(end)):
                return end
        return first
