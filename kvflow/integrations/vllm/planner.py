"""The scheduler side of the vLLM connector, without vLLM: which chunks of which request to
load into which blocks, and which newly computed chunks to save, step by step.

A chunk is ``chunk_blocks`` vLLM blocks; its key is its last block's hash (vLLM's block hashes
are prefix-chained, so that hash names the whole prefix). Only prompt chunks are stored. A hit
never covers the whole prompt: the token that produces the first output is always computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ChunkPlanner", "Transfer"]


@dataclass(frozen=True)
class Transfer:
    """One request's part of a step's load or save: chunk hashes and their blocks in order."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first_chunk: int


@dataclass
class _Tracked:
    block_hashes: Callable[[], Sequence[bytes]]
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0  # chunks [0, stored_chunks) need no save


class ChunkPlanner:
    """``lookup(hashes)`` says, per chunk hash, whether every rank's object is in the pool (a
    failing pool answers all False)."""

    def __init__(
        self,
        *,
        block_size: int,
        chunk_blocks: int,
        lookup: Callable[[list[bytes]], np.ndarray],
        load: bool = True,
        save: bool = True,
    ) -> None:
        self.block_size = block_size
        self.chunk_blocks = chunk_blocks
        self.chunk_tokens = block_size * chunk_blocks
        self._lookup = lookup
        self._load, self._save = load, save
        self._tracked: dict[str, _Tracked] = {}
        self._hits: dict[str, tuple[int, int]] = {}  # req_id -> (first chunk, chunks) found
        self._loads: dict[str, tuple[int, int]] = {}  # allocated: load in the next step

    def chunk_hashes(
        self, block_hashes: Sequence[bytes], first: int, end: int
    ) -> tuple[bytes, ...]:
        cb = self.chunk_blocks
        return tuple(bytes(block_hashes[(c + 1) * cb - 1]) for c in range(first, end))

    def matched_tokens(
        self,
        req_id: str,
        block_hashes: Callable[[], Sequence[bytes]],
        prompt_tokens: int,
        num_computed: int,
    ) -> int:
        """Tokens beyond ``num_computed`` the pool can provide: a run of whole chunks that starts
        at ``num_computed`` (which must be chunk-aligned) and ends before the last prompt token."""
        self._tracked.setdefault(req_id, _Tracked(block_hashes, prompt_tokens))
        self._hits.pop(req_id, None)
        if not self._load or num_computed % self.chunk_tokens:
            return 0
        hashes = block_hashes()
        first = num_computed // self.chunk_tokens
        end = min((prompt_tokens - 1) // self.chunk_tokens, len(hashes) // self.chunk_blocks)
        if end <= first:
            return 0
        found = np.asarray(self._lookup(list(self.chunk_hashes(hashes, first, end))), dtype=bool)
        misses = np.flatnonzero(~found)
        hits = int(misses[0]) if misses.size else int(found.size)
        if hits:
            self._hits[req_id] = (first, hits)
        return hits * self.chunk_tokens

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM allocated blocks for ``num_external_tokens`` of the hit (0: it loads nothing)."""
        hit = self._hits.pop(req_id, None)
        if hit is None or num_external_tokens <= 0:
            return
        first, chunks = hit
        chunks = min(chunks, num_external_tokens // self.chunk_tokens)
        if chunks:
            self._loads[req_id] = (first, chunks)

    def step(
        self,
        scheduled: Sequence[tuple[str, Sequence[int] | None, bool, int, int]],
    ) -> tuple[list[Transfer], list[Transfer]]:
        """One scheduler step. ``scheduled``: per request, ``(req_id, block ids (all of them
        when ``replace``, else the new ones, or None), replace, tokens computed before the
        step, tokens scheduled in it)``. Returns the step's loads and saves."""
        loads, saves = [], []
        for req_id, block_ids, replace, computed, scheduled_tokens in scheduled:
            t = self._tracked.get(req_id)
            if t is None:
                continue
            if replace:
                t.block_ids = list(block_ids or ())
            elif block_ids:
                t.block_ids.extend(block_ids)
            hashes = t.block_hashes()
            load = self._loads.pop(req_id, None)
            if load is not None:
                first, chunks = load
                loads.append(self._transfer(req_id, t, hashes, first, first + chunks))
                t.stored_chunks = max(t.stored_chunks, first + chunks)
            if not self._save:
                continue
            done = min(computed + scheduled_tokens, t.prompt_tokens) // self.chunk_tokens
            done = min(
                done, len(hashes) // self.chunk_blocks, len(t.block_ids) // self.chunk_blocks
            )
            if done > t.stored_chunks:
                saves.append(self._transfer(req_id, t, hashes, t.stored_chunks, done))
                t.stored_chunks = done
        return loads, saves

    def finished(self, req_id: str) -> None:
        for table in (self._tracked, self._hits, self._loads):
            table.pop(req_id, None)

    @property
    def tracked(self) -> int:
        return len(self._tracked)

    def _transfer(
        self, req_id: str, t: _Tracked, hashes: Sequence[bytes], first: int, end: int
    ) -> Transfer:
        cb = self.chunk_blocks
        return Transfer(
            req_id,
            self.chunk_hashes(hashes, first, end),
            tuple(t.block_ids[first * cb : end * cb]),
            first,
        )
