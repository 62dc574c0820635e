"""ChunkGrid: where a request's chunks, blocks and sliding window fall (pure arithmetic).

A chunk is ``chunk_blocks`` vLLM blocks of ``block_size`` tokens; its key is its last block's
hash (vLLM's block hashes are prefix-chained, so that hash names the whole prefix). A chunk's
tail, its first blocks (fewer than a chunk's: a prompt's last whole blocks), is an object of its
own, keyed the same way by its own last block (no whole chunk's key: those end at a chunk
boundary); its places after those blocks hold the chunk before's last blocks (real KV, which a
tail's load skips), so the first chunk has no tail.

With sliding-window attention (``window``: the tokens whose blocks vLLM keeps behind a position,
its own included), vLLM keeps only the blocks the next token's window reads and puts its null
block (``NULL_BLOCK``) in the block table for the others; a hit ending at chunk ``E`` then needs
only the chunks that hold a block of the window before ``E``. No state, no I/O: the planner
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

    def tail_hash(self, block_hashes: Sequence[bytes], chunk: int, blocks: int) -> bytes:
        """The key of chunk ``chunk``'s tail of ``blocks`` blocks (fewer than a chunk's): its
        last block's hash, which no whole chunk's key is (those end at a chunk boundary)."""
        return bytes(block_hashes[chunk * self.chunk_blocks + blocks - 1])

    def tails(self, first: int, most: int, held: int) -> list[tuple[int, int]]:
        """``(chunk, blocks)`` of every tail a hit may end with: of the chunks from ``first``
        but the first (a tail's save pads with the chunk before's blocks), ending after the
        ``held`` blocks (vLLM's own hit) and at block ``most`` at the latest."""
        cb = self.chunk_blocks
        return [
            (chunk, blocks)
            for chunk in range(max(first, 1), most // cb + 1)
            for blocks in range(1, cb)
            if held < chunk * cb + blocks <= most
        ]

    def longest_tails(
        self, tails: Sequence[tuple[int, int]], found: np.ndarray, first: int, end: int
    ) -> np.ndarray:
        """Per chunk in ``[first, end]``, the blocks of its longest tail found (0: none), from
        ``tails`` (as ``tails()`` gives them) and ``found[i]``: whether ``tails[i]`` was."""
        longest = np.zeros(end - first + 1, dtype=np.int64)
        for (chunk, blocks), f in zip(tails, found, strict=True):
            if f:
                longest[chunk - first] = max(longest[chunk - first], blocks)
        return longest

    def tail_block_ids(self, block_ids: Sequence[int], chunk: int, blocks: int) -> tuple[int, ...]:
        """The places of chunk ``chunk``'s tail object of ``blocks`` blocks (``chunk`` > 0), for
        its save: those blocks, then the chunk before's last blocks (real KV, distinct blocks,
        never loaded: a tail's load skips them)."""
        start = chunk * self.chunk_blocks
        rest = self.chunk_blocks - blocks
        return (*block_ids[start : start + blocks], *block_ids[start - rest : start])

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
