"""The eviction part of ``kvflow bench pool``: what a pool under pressure keeps of use.

A prompt mix (system prompts shared by many conversations, conversations that grow turn by turn,
repeats, lookups of earlier prompts' prefixes) is keyed with the real prefix-chained chunk keys
and replayed through a pool that holds a fraction of its chunks: per request a lookup, then for
a served prompt a load of the hit (``open_read``/``close_read``) and a save (``open_write``/
``finish_write``). Three save patterns:

* ``whole``: the whole prompt in one call, as ``TransferEngine.save`` does;
* ``new``: only the chunks after the hit, ``SEGMENT`` per call, as the vLLM connector saved a
  long prompt's new chunks step by step (chunked prefill) before it named the chunks before
  them;
* ``new_context``: the same calls, each naming the prompt's chunks before its own as context
  (the prefix context of ``kvflow.stores.base``), as the vLLM connector does now. The model of
  the old policy has no context: its row is the ``new`` one's.

Figures: ``reachable``, the share of the pool's used bytes that a lookup from a prompt's start
reaches (a chunk after a missing one never is), and ``hit_rate``, the chunks that lookups found
in their leading run over the chunks they asked for. ``before`` is the policy up to 2026-12-01,
plain LRU with every call touching its keys first to last, replayed through ``PlainLru`` (a
model of it: objects of one size, nothing concurrent); ``after`` is the pools' own
``ArenaIndex`` in a LocalStore and in a ``kvflow serve`` pool. Reachability is read at the end
of replays of growing prefixes of the trace (each on a fresh pool: the probe's lookups touch).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvflow.bench.stores import bench_store
from kvflow.errors import ConfigError
from kvflow.keys import KeySpace, chunk_hashes
from kvflow.stores.arena import SLOT_ALIGN
from kvflow.stores.base import (
    ReadSession,
    StoreUsage,
    WriteSession,
    WriteStatus,
)

__all__ = [
    "PATTERNS",
    "TARGET_PATTERNS",
    "PlainLru",
    "Request",
    "check",
    "label",
    "measure",
    "prompt_mix",
    "replay",
    "run",
]

TOKENS_PER_CHUNK = 16
OBJECT_BYTES = SLOT_ALIGN  # one slot per chunk: the figures count chunks
SEGMENT = 4  # chunks per save call in the ``new`` patterns
PATTERNS = ("whole", "new", "new_context")
TARGET_PATTERNS = ("whole", "new_context")  # the pools keep >= 99 % reachable for these
_MAX_CHUNKS = 48  # a conversation ends when its prompt would pass this


@dataclass(frozen=True)
class Request:
    """One request of the mix: a served prompt (lookup, load, save) or a lookup alone."""

    serve: bool
    keys: tuple[str, ...]


@runtime_checkable
class Pool(Protocol):
    """What the replay calls: a Store with usage(), or the model of the old policy."""

    def lookup(self, keys: Sequence[str]) -> np.ndarray: ...
    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession: ...
    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession: ...
    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None: ...
    def open_read(self, keys: Sequence[str]) -> ReadSession: ...
    def close_read(self, session: ReadSession) -> None: ...
    def usage(self) -> StoreUsage: ...


def prompt_mix(requests: int, seed: int = 0) -> list[Request]:
    """``requests`` requests: 30 % new conversations (one of 24 system prompts, popular ones
    more often, and a question), 35 % a conversation's next turn (its last prompt, an answer and
    a question), 20 % repeats of a recent prompt, 15 % lookups of a prefix of a recent prompt."""
    rng = np.random.default_rng(seed)
    space = KeySpace(namespace="kvflow-bench-eviction", rank=0)

    def text(chunks: int) -> np.ndarray:
        return rng.integers(0, 1 << 30, chunks * TOKENS_PER_CHUNK + int(rng.integers(16)))

    def recent(n: int) -> int:  # an index among n, the later the likelier
        return n - 1 - min(int(rng.geometric(0.08)) - 1, n - 1)

    systems = [
        rng.integers(0, 1 << 30, TOKENS_PER_CHUNK * int(rng.integers(1, 9))) for _ in range(24)
    ]
    popularity = 1.0 / np.arange(1, len(systems) + 1) ** 1.1
    popularity /= popularity.sum()
    talks: list[np.ndarray] = []
    served: list[np.ndarray] = []
    out: list[Request] = []
    for _ in range(requests):
        roll = rng.random()
        serve = True
        if roll < 0.30 or not talks:
            system = systems[int(rng.choice(len(systems), p=popularity))]
            tokens = np.concatenate([system, text(int(rng.integers(1, 7)))])
            talks.append(tokens)
        elif roll < 0.65:
            i = recent(len(talks))
            tokens = np.concatenate([talks[i], text(int(rng.integers(1, 5)))])
            if len(tokens) > _MAX_CHUNKS * TOKENS_PER_CHUNK:
                tokens = talks.pop(i)  # the conversation ends: asked once more as it was
            else:
                talks[i] = tokens
        elif roll < 0.85:
            tokens = served[recent(len(served))]
        else:
            earlier = served[recent(len(served))]
            tokens, serve = earlier[: int(rng.integers(1, len(earlier) + 1))], False
        if serve:
            served.append(tokens)
        out.append(Request(serve, tuple(space.keys(chunk_hashes(tokens, TOKENS_PER_CHUNK)))))
    return out


def replay(pool: Pool, trace: Sequence[Request], pattern: str) -> tuple[int, int]:
    """Run ``trace`` through ``pool``; returns (chunks found in the lookups' leading runs,
    chunks the lookups asked for)."""
    hits = asked = 0
    for request in trace:
        keys = request.keys
        if not keys:
            continue
        hit = _leading(pool.lookup(keys))
        hits, asked = hits + hit, asked + len(keys)
        if not request.serve:
            continue
        if hit:
            pool.close_read(pool.open_read(keys[:hit]))
        if pattern == "whole":
            _save(pool, keys)
        else:
            for start in range(hit, len(keys), SEGMENT):
                context = keys[:start] if pattern == "new_context" else ()
                _save(pool, keys[start : start + SEGMENT], context)
    return hits, asked


def label(pattern: str) -> str:
    """How the report names a save pattern."""
    return {
        "whole": "whole prompt",
        "new": f"new chunks, {SEGMENT} a call",
        "new_context": f"new chunks, {SEGMENT} a call, naming the chunks before",
    }[pattern]


def reachable_share(pool: Pool, trace: Sequence[Request]) -> float:
    """The share of the pool's used bytes that a lookup of some prompt of ``trace`` reaches
    (every chunk stored belongs to one of them). Touches what it finds."""
    reachable: set[str] = set()
    for keys in {r.keys for r in trace}:
        reachable.update(keys[: _leading(pool.lookup(keys))])
    used = pool.usage().used
    return len(reachable) * OBJECT_BYTES / used if used else 1.0


def measure(
    open_pool: Callable[[], AbstractContextManager[Pool]],
    trace: Sequence[Request],
    pattern: str,
    checkpoints: int,
) -> dict[str, float]:
    """Reachability at ``checkpoints`` points of the trace (mean and worst) and the hit rate of
    the whole trace."""
    shares = []
    hits = asked = 0
    for n in range(1, checkpoints + 1):
        part = trace[: len(trace) * n // checkpoints]
        with open_pool() as pool:
            hits, asked = replay(pool, part, pattern)
            shares.append(reachable_share(pool, part))
    return {
        "reachable": statistics.fmean(shares),
        "reachable_min": min(shares),
        "hit_rate": hits / asked if asked else 0.0,
    }


def pools(objects: int) -> dict[str, Callable[[], AbstractContextManager[Pool]]]:
    """How to open each pool the figures compare, holding ``objects`` chunks."""

    @contextmanager
    def model() -> Iterator[Pool]:
        yield PlainLru(objects)

    @contextmanager
    def real(kind: str) -> Iterator[Pool]:
        with bench_store(kind, objects * OBJECT_BYTES) as store:
            assert isinstance(store, Pool)
            yield store

    return {
        "before": model,
        "local": lambda: real("local"),
        "shared": lambda: real("shared"),
    }


def run(requests: int, objects: int, checkpoints: int, seed: int = 0) -> dict[str, Any]:
    """Every pattern on every pool of ``pools``; JSON-ready. ``ratio``: after (the local pool)
    over before, per pattern; ``context_ratio``: the local pool's ``new_context`` over its
    ``new`` (what naming the chunks before a save gains)."""
    check(requests, objects, checkpoints)
    trace = prompt_mix(requests, seed)
    rows: list[dict[str, Any]] = []
    for pattern in PATTERNS:
        for name, open_pool in pools(objects).items():
            figures = measure(open_pool, trace, pattern, checkpoints)
            rows.append({"pattern": pattern, "pool": name, **figures})
    by = {(r["pattern"], r["pool"]): r for r in rows}
    ratio = {
        pattern: {
            what: by[pattern, "local"][what] / by[pattern, "before"][what]
            if by[pattern, "before"][what]
            else math.inf
            for what in ("reachable", "hit_rate")
        }
        for pattern in PATTERNS
    }
    with_context, without = by["new_context", "local"], by["new", "local"]
    context_ratio = {
        what: with_context[what] / without[what] if without[what] else math.inf
        for what in ("reachable", "reachable_min", "hit_rate")
    }
    return {
        "requests": requests,
        "pool_chunks": objects,
        "distinct_chunks": len({k for r in trace for k in r.keys}),
        "checkpoints": checkpoints,
        "segment": SEGMENT,
        "rows": rows,
        "ratio": ratio,
        "context_ratio": context_ratio,
    }


def check(requests: int, objects: int, checkpoints: int) -> None:
    """Refuse sizes ``run`` cannot use (ConfigError naming the option), before any work."""
    for option, value in (
        ("--eviction-requests", requests),
        ("--eviction-pool", objects),
        ("--eviction-checkpoints", checkpoints),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(option, value, "must be an integer >= 1")
    if checkpoints > requests:
        raise ConfigError(
            "--eviction-checkpoints", checkpoints, f"must not exceed the requests ({requests})"
        )


class PlainLru:
    """The eviction policy before 2026-12-02, as a model: a pool of ``objects`` objects of one
    size, plain LRU, every call touching its keys first to last (a load's leases rejoin the
    LRU first to last). Sequential use only: leases are released before the next call."""

    def __init__(self, objects: int) -> None:
        self.objects = objects
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[int, dict[str, None]] = {}
        self._handles = 0

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        found = np.array([key in self._lru for key in keys], dtype=bool)
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)
        return found

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        found = self.lookup(keys)  # leased and released in order: a touch in order
        return ReadSession(0, tuple(keys), np.zeros(len(keys), dtype=np.int64), found)

    def close_read(self, session: ReadSession) -> None:
        pass

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        status = np.full(len(keys), WriteStatus.EXISTS, dtype=np.int8)
        granted: dict[str, None] = {}
        for i, key in enumerate(keys):
            if key in self._lru:
                self._lru.move_to_end(key)
            elif key not in granted:
                if len(self._lru) + len(granted) >= self.objects:
                    if not self._lru:
                        status[i] = WriteStatus.NO_SPACE
                        continue
                    self._lru.popitem(last=False)
                granted[key] = None
                status[i] = WriteStatus.GRANTED
        self._handles += 1
        self._pending[self._handles] = granted
        return WriteSession(self._handles, tuple(keys), np.zeros(len(keys), np.int64), status)

    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession:
        return self.open_write(keys, nbytes)  # the old policy knew no context

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        for key in self._pending.pop(session.handle):  # all committed: the replay writes all
            self._lru[key] = None

    def usage(self) -> StoreUsage:
        n = len(self._lru)
        return StoreUsage(self.objects * OBJECT_BYTES, n * OBJECT_BYTES, n, 0, 0, 0, 0, 0, 0, 0)


def _leading(found: np.ndarray) -> int:
    misses = np.flatnonzero(~np.asarray(found, dtype=bool))
    return int(misses[0]) if misses.size else len(found)


def _save(pool: Pool, keys: Sequence[str], context: Sequence[str] = ()) -> None:
    """One save call; ``context`` goes to pools that take it (the model has none)."""
    if context:
        session = pool.open_write_with_context(keys, OBJECT_BYTES, context)
    else:
        session = pool.open_write(keys, OBJECT_BYTES)
    pool.finish_write(session, np.ones(len(keys), dtype=bool))
