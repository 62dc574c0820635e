"""Stand-ins for what vLLM hands the connector's scheduler side, for the planner tests without
vLLM: requests with prefix-chained block hashes (as vLLM's), a pool that is a set of stored
chunk hashes, a clock to move by hand, step entries, and the transfers a step should plan;
and an attention spec with only the attributes kvflow's layout fingerprint reads."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvflow.integrations.vllm.planner import NULL_BLOCK, ChunkPlanner, Transfer

__all__ = [
    "BS",
    "CB",
    "CT",
    "Clock",
    "Entry",
    "FakePool",
    "FakeRequest",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "chained",
    "expected",
    "match",
    "new",
    "per_chunk",
    "planner",
    "request",
    "running",
    "stored",
    "vllm_table",
    "words",
]

BS = 4  # tokens per vLLM block
CB = 2  # vLLM blocks per chunk
CT = BS * CB  # tokens per chunk

Entry = tuple[str, "list[int] | None", bool, int, int]  # one request's part of ``step``


def chained(words: Sequence[str]) -> list[bytes]:
    """Prefix-chained block hashes: block i's hash covers words[0..i], like vLLM's."""
    out: list[bytes] = []
    parent = b""
    for word in words:
        parent = hashlib.sha256(parent + word.encode()).digest()
        out.append(parent)
    return out


def words(prefix: str, n: int, start: int = 0) -> list[str]:
    """``n`` block contents named ``prefix-i``."""
    return [f"{prefix}-{i}" for i in range(start, start + n)]


@dataclass
class FakeRequest:
    """A request as the planner sees it: an id, its prompt length and its full blocks' hashes
    (vLLM hashes full blocks only; the list grows as decode fills blocks)."""

    req_id: str
    prompt_tokens: int
    hashes: list[bytes]

    def block_hashes(self) -> list[bytes]:
        return self.hashes

    def chunk_hash(self, chunk: int) -> bytes:
        """The pool key of chunk ``chunk``: its last block's hash."""
        return self.hashes[(chunk + 1) * CB - 1]

    def tail_hash(self, chunk: int, blocks: int) -> bytes:
        """The pool key of chunk ``chunk``'s tail of ``blocks`` blocks: its last block's hash."""
        return self.hashes[chunk * CB + blocks - 1]

    def decode(self, tokens: int) -> None:
        """Append the hashes of blocks that ``tokens`` more tokens fill."""
        total = self.prompt_tokens + tokens
        while len(self.hashes) < total // BS:
            self.hashes.append(chained([self.hashes[-1].hex(), f"decode-{len(self.hashes)}"])[-1])


def request(req_id: str, prompt_tokens: int, prefix: str | None = None) -> FakeRequest:
    """A request whose prompt is ``prompt_tokens`` tokens of blocks named after ``prefix``."""
    return FakeRequest(req_id, prompt_tokens, chained(words(prefix or req_id, prompt_tokens // BS)))


@dataclass
class FakePool:
    """A lookup backed by a set of stored chunk hashes; records every call's hashes (and, in
    ``preceding``, the hashes it named as the chunks before them)."""

    stored: set[bytes] = field(default_factory=set)
    calls: list[list[bytes]] = field(default_factory=list)
    preceding: list[list[bytes]] = field(default_factory=list)

    def lookup(self, hashes: list[bytes], preceding: list[bytes]) -> np.ndarray:
        self.calls.append(list(hashes))
        self.preceding.append(list(preceding))
        return np.array([h in self.stored for h in hashes], dtype=bool)

    def store(self, req: FakeRequest, chunks: Iterable[int]) -> None:
        """Store chunks of ``req`` (by chunk index)."""
        self.stored.update(req.chunk_hash(c) for c in chunks)

    def store_saves(self, saves: Iterable[Transfer]) -> None:
        """Store what a step saved."""
        for t in saves:
            self.stored.update(t.hashes)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def planner(
    pool: FakePool,
    *,
    load: bool = True,
    save: bool = True,
    save_generated: bool = False,
    window: int = 0,
    tails: bool = False,
    seen_limit: int = 1 << 16,
    clock: Clock | None = None,
) -> ChunkPlanner:
    """A planner with BS-token blocks and CB-block chunks over ``pool`` (``tails``: see
    ``planner.py``)."""
    return ChunkPlanner(
        block_size=BS,
        chunk_blocks=CB,
        lookup=pool.lookup,
        load=load,
        save=save,
        save_generated=save_generated,
        window=window,
        tails=tails,
        seen_limit=seen_limit,
        clock=clock or Clock(),
    )


def stored(
    req_id: str, prompt_tokens: int, *, chunks: int
) -> tuple[FakePool, FakeRequest, ChunkPlanner]:
    """A pool holding the request's first ``chunks`` chunks, the request, and a planner."""
    pool = FakePool()
    req = request(req_id, prompt_tokens)
    pool.store(req, range(chunks))
    return pool, req, planner(pool)


def match(p: ChunkPlanner, req: FakeRequest, num_computed: int = 0) -> int:
    """``matched_tokens`` for ``req``, as the connector calls it."""
    return p.matched_tokens(req.req_id, req.block_hashes, req.prompt_tokens, num_computed)


def new(req: FakeRequest, block_ids: Sequence[int], computed: int, scheduled: int) -> Entry:
    """A newly scheduled request's entry in ``step``: all its block ids, replace=True."""
    return (req.req_id, list(block_ids), True, computed, scheduled)


def running(
    req: FakeRequest, new_ids: Sequence[int] | None, computed: int, scheduled: int
) -> Entry:
    """A running request's entry in ``step``: only its new block ids (or None)."""
    return (req.req_id, None if new_ids is None else list(new_ids), False, computed, scheduled)


def per_chunk(transfers: Iterable[Transfer]) -> list[tuple[str, int, bytes, tuple[int, ...]]]:
    """Each transfer as ``(req_id, chunk index, chunk hash, its CB block ids)`` per chunk,
    checking that every transfer has CB block ids per hash."""
    out = []
    for t in transfers:
        assert len(t.block_ids) == CB * len(t.hashes), t
        assert len(t.hashes) > 0, t
        for i, h in enumerate(t.hashes):
            out.append((t.req_id, t.first_chunk + i, h, tuple(t.block_ids[i * CB : (i + 1) * CB])))
    return out


def expected(
    req: FakeRequest, chunks: Iterable[int], block_ids: Sequence[int]
) -> list[tuple[str, int, bytes, tuple[int, ...]]]:
    """What ``per_chunk`` should give for ``chunks`` of ``req`` held in ``block_ids``."""
    return [
        (req.req_id, c, req.chunk_hash(c), tuple(block_ids[c * CB : (c + 1) * CB])) for c in chunks
    ]


def vllm_table(req: FakeRequest, window: int, computed: int) -> list[int]:
    """The block table vLLM gives a request scheduled with ``computed`` tokens already
    computed under a sliding ``window``: its null block for the blocks before the window of
    token ``computed``, then ``100 + i`` for block i."""
    blocks = -(-req.prompt_tokens // BS)
    dropped = max(0, computed - window + 1) // BS
    return [NULL_BLOCK] * dropped + [100 + i for i in range(dropped, blocks)]


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """A stand-in for vLLM's attention spec: only the attributes the fingerprint reads."""

    block_size: int = 16
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: Any = torch.bfloat16
    page_size_bytes: int = 2 * 16 * 8 * 128 * 2


@dataclasses.dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Another kind of spec with the same attributes."""
