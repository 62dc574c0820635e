"""What the scheduler side remembers between steps: per request, its state (``RequestState``)
and the hit its lookup found (``Hit``); across requests, the chunk hashes seen in the pool
(``SeenChunks``).

A chunk seen in the pool (a lookup found it, or its save was planned) counts as stored for
``RECENT_S``; a waiting request's lookup answers its next ones for ``REUSE_S``. How the planner
uses both is in ``planner.py``'s docstring. Not thread-safe, like the planner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RECENT_S", "REUSE_S", "SEEN_LIMIT", "Hit", "RequestState", "SeenChunks"]

RECENT_S = 60.0  # how long a chunk seen in the pool (or planned for saving) counts as stored
REUSE_S = 1.0  # how long a waiting request's lookup answers its next ones
SEEN_LIMIT = 1 << 16  # chunk hashes remembered, by default


@dataclass(frozen=True)
class Hit:
    """Chunks ``[first, first + chunks)`` found in the pool, and the ``tail`` first blocks of
    chunk ``first + chunks`` (a tail object: see ``planner.py``); the first ``skip`` blocks of
    chunk ``first`` are vLLM's own prefix-cache hit."""

    first: int
    chunks: int
    skip: int
    tail: int = 0


@dataclass
class RequestState:
    """One request the planner follows, from its first lookup until it finishes."""

    block_hashes: Callable[[], Sequence[bytes]]
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0  # chunks [0, stored_chunks) need no save
    # the last lookup: num_computed, when, its first chunk, what it found (None: nothing asked)
    # and the longest tail found per chunk from the first (blocks; None: no tails asked)
    answer: tuple[int, float, int, np.ndarray | None, np.ndarray | None] | None = None
    load_failed: bool = False  # an asynchronous load failed: vLLM recomputes, no hit again


class SeenChunks:
    """Chunk hashes seen in the pool and when each was last seen: at most ``limit`` of them,
    the least recently seen dropped first."""

    def __init__(self, limit: int, clock: Callable[[], float]) -> None:
        self._limit = max(1, limit)
        self._clock = clock
        self._when: OrderedDict[bytes, float] = OrderedDict()

    def add(self, hashes: Iterable[bytes]) -> None:
        now = self._clock()
        for h in hashes:
            self._when.pop(h, None)
            self._when[h] = now
        while len(self._when) > self._limit:
            self._when.popitem(last=False)

    def clear(self) -> None:
        self._when.clear()

    def discard(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._when.pop(h, None)

    def recent(self, h: bytes) -> bool:
        when = self._when.get(h)
        return when is not None and self._clock() - when < RECENT_S

    def __len__(self) -> int:
        return len(self._when)

    def __contains__(self, h: object) -> bool:
        return h in self._when
