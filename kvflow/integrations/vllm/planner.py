"""The scheduler side of the vLLM connector, without vLLM: which chunks of which request to
load into which blocks, and which newly computed chunks to save, step by step.

A chunk is ``chunk_blocks`` vLLM blocks; its key is its last block's hash (vLLM's block hashes
are prefix-chained, so that hash names the whole prefix; the arithmetic of chunks and windows is
``chunks.py``'s, what the planner remembers between steps ``tracking.py``'s). Prompt chunks are
stored in the step that computes their last token; with ``save_generated`` the chunks of
generated tokens too, each in the step after the one that computed its last token (the tokens
computed before a step are final: a speculative step's rejected drafts are not among them). A
hit never covers the whole prompt: the token that produces the first output is always computed.
A planner that does not save (``save`` false: a ``kv_consumer``) counts the prompt chunks it
would have saved (``take_unsaved_chunks``).

With ``tails`` (not with a sliding window or asynchronous loads), a prompt's last whole blocks
short of a chunk are stored too, in the step that completes it, as a tail object (``chunks.py``);
a lookup asks for the tails beside the chunks, and a hit is a run of whole chunks and then the
longest tail found of the chunk after them: a later prompt that extends this one (the next turn,
a resumed request, a decode node's prompt) hits up to its last whole block.

A load starts in the chunk where vLLM's own prefix-cache hit ends. That hit is counted in
blocks, so it often ends inside a chunk: the chunk is loaded all the same, its blocks vLLM holds
named ``SKIP_BLOCK`` (nothing is written into them; other requests may be reading them).

Chunks vLLM's own prefix cache provides are saved unless the planner saw them in the pool (a
lookup found them) or planned their save within ``RECENT_S``: vLLM's cache holds them because
this instance computed or loaded them, so the pool normally has them and a save would move
nothing, yet cost the step a write session. Chunks it did not see (a conversation's earlier
answer, which vLLM cached and no prompt saved) are saved, up to where the request's load
starts. A chunk the pool dropped since, or whose planned save failed, is saved again at the
first such hit after ``RECENT_S``, or sooner if a lookup finds it missing, or once the pool
may have lost everything (``forget_pool``: it restarted, or could not be reached).

A request waiting for device blocks is asked about again at every scheduler step: its lookup's
answer is reused for ``REUSE_S`` (the pool is asked again after that, or once vLLM's own hit
changed, or it was scheduled since), so that a queue of waiting requests costs the scheduler no
pool round trips per step.
A chunk evicted meanwhile fails its load, and vLLM recomputes it, as after any lookup.

Sliding-window attention (``window``: the tokens whose blocks vLLM keeps behind a position, its
own included: the window, and any it retains beyond): vLLM keeps only the blocks the next
token's window reads and puts its null block (``NULL_BLOCK``) in the block table for the others.
A hit ending at token ``E`` then needs only the chunks that hold a block of the window before
``E``: every chunk from the first is looked up as without a window, and the hit is the longest
whose window chunks were all found; those alone are loaded, into the blocks vLLM allocated (the
null block's places are ``SKIP_BLOCK``), and the chunks before them count as computed without
being moved. Such loads are asynchronous for vLLM (``async_loads``): planned when vLLM allocates
the blocks, started by the next step, and the request runs once they are in. vLLM recomputes a
failed synchronous load from its first failed block, whose window the load did not bring; a
failed asynchronous one it recomputes from the first token. A chunk is saved only while vLLM
still holds all its blocks: one that a chunked prefill completes after the window left its first
block is not (a later lookup needs it only for hits ending within a window of it).

Lookups, loads and saves that start after a prompt's first chunk (after what vLLM's cache holds,
or at the new chunks) name the chunks before them too (``preceding``): the pool touches those
after the moved ones, so that it evicts a prompt's tail before its head
(the prefix context of ``kvflow.abc.Store``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.integrations.vllm.chunks import NULL_BLOCK, ChunkGrid
from kvflow.integrations.vllm.tracking import (
    RECENT_S,
    REUSE_S,
    SEEN_LIMIT,
    Hit,
    RequestState,
    SeenChunks,
)
from kvflow.layout import SKIP_BLOCK

__all__ = ["NULL_BLOCK", "RECENT_S", "REUSE_S", "ChunkPlanner", "Transfer"]


@dataclass(frozen=True)
class Transfer:
    """One request's part of a step's load or save: chunk hashes and their blocks in order,
    from chunk ``first_chunk``; ``preceding``: the hashes of the prompt's chunks before it
    (``kvflow.ChunkHashes.preceding``: not moved, they order the pool's eviction); ``group``:
    the KV cache group (vLLM's hybrid KV cache manager gives each its layers and blocks);
    ``tail``: the last chunk is a tail object of that many blocks (0: a whole chunk)."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first_chunk: int
    preceding: tuple[bytes, ...] = ()
    group: int = 0  # vLLM's KV cache group whose layers and blocks these are
    tail: int = 0


class ChunkPlanner:
    """``lookup(hashes, preceding)`` says, per chunk hash, whether every rank's object is in
    the pool (a failing pool answers all False); ``preceding`` are the hashes of the prompt's
    chunks before them, for the pool's eviction order only. ``window``: sliding-window
    attention's kept tokens (0: full attention; see the module's docstring). ``seen_limit`` bounds
    the chunk hashes remembered as seen in the pool (see the module's docstring); ``clock``
    gives the time in seconds they are remembered by; ``grid``: the chunk and window arithmetic.
    Not thread-safe: vLLM calls the scheduler side from one thread."""

    def __init__(
        self,
        *,
        block_size: int,
        chunk_blocks: int,
        lookup: Callable[[list[bytes], list[bytes]], np.ndarray],
        load: bool = True,
        save: bool = True,
        save_generated: bool = False,
        window: int = 0,
        async_loads: bool | None = None,
        tails: bool = False,
        group: int = 0,
        seen_limit: int = SEEN_LIMIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grid = ChunkGrid(block_size, chunk_blocks, window)
        self.block_size = block_size
        self.chunk_blocks = chunk_blocks
        self.chunk_tokens = block_size * chunk_blocks
        self.window = window
        self.group = group
        self._async = bool(window) if async_loads is None else async_loads
        self._tails = tails and chunk_blocks > 1 and not window and not self._async
        self.asked_tokens = 0  # tokens the pool was asked about, so far
        self._lookup = lookup
        self._load, self._save = load, save
        self._save_generated = save_generated
        self._unsaved = 0  # prompt chunks computed and not saved (``save`` false), uncounted yet
        self._tracked: dict[str, RequestState] = {}
        self._hits: dict[str, Hit] = {}  # found by the lookup
        self._loads: dict[str, Hit] = {}  # allocated: load in the next step
        self._async_loads: list[Transfer] = []  # allocated, asynchronous: start at the next step
        self._seen = SeenChunks(seen_limit, clock)
        self._clock = clock

    def chunk_hashes(
        self, block_hashes: Sequence[bytes], first: int, end: int
    ) -> tuple[bytes, ...]:
        return self.grid.chunk_hashes(block_hashes, first, end)

    def matched_tokens(
        self,
        req_id: str,
        block_hashes: Callable[[], Sequence[bytes]],
        prompt_tokens: int,
        num_computed: int,
        limit: int | None = None,
    ) -> int:
        """Tokens beyond ``num_computed`` the pool can provide: a run of whole chunks from the one
        that holds token ``num_computed`` (which must start a block), then with tails the
        longest tail found of the chunk after it, ending before the last prompt token (with a
        sliding window, the run needs only the chunks of the window before its end), and at
        chunk ``limit`` at the latest (given: the last answer is reused; then no tail)."""
        t = self._tracked.setdefault(req_id, RequestState(block_hashes, prompt_tokens))
        self._hits.pop(req_id, None)
        if not self._load or num_computed % self.block_size or t.load_failed:
            return 0
        now = self._clock()
        fresh = t.answer is not None and now - t.answer[1] < REUSE_S
        if t.answer is None or t.answer[0] != num_computed or not (fresh or limit is not None):
            t.answer = (num_computed, now, *self._ask(block_hashes(), prompt_tokens, num_computed))
        first, found, tails = t.answer[2:]
        hits = 0 if found is None else self.grid.hit_end(found, first, limit) - first
        tail = 0 if tails is None or limit is not None else int(tails[hits])
        if not hits and not tail:
            return 0
        skip = num_computed // self.block_size - first * self.chunk_blocks
        self._hits[req_id] = Hit(first, hits, skip, tail)
        return (first + hits) * self.chunk_tokens + tail * self.block_size - num_computed

    def _ask(
        self, hashes: Sequence[bytes], prompt_tokens: int, num_computed: int
    ) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """Look up the chunks a hit after ``num_computed`` tokens may take: the first of them,
        per chunk whether it was found (None: none to ask), and with tails, per chunk from the
        first, the blocks of its longest tail found beyond ``num_computed`` (0: none)."""
        first = num_computed // self.chunk_tokens
        most = min((prompt_tokens - 1) // self.block_size, len(hashes))  # blocks a hit may end at
        end = most // self.chunk_blocks
        tails = self.grid.tails(first, most, num_computed // self.block_size) if self._tails else []
        if end <= first and not tails:
            return first, None, None
        asked = self.chunk_hashes(hashes, first, max(first, end))
        keys = list(asked) + [self.grid.tail_hash(hashes, c, b) for c, b in tails]
        preceding = self.chunk_hashes(hashes, 0, first)
        found = np.asarray(self._lookup(keys, list(preceding)), dtype=bool)
        self.asked_tokens += (most if tails else end * self.chunk_blocks) * self.block_size
        self.asked_tokens -= first * self.chunk_tokens
        self._seen.add(h for h, f in zip(keys, found, strict=True) if f)
        self._seen.discard(h for h, f in zip(keys, found, strict=True) if not f)
        if not self._tails:
            return first, found, None
        longest = self.grid.longest_tails(tails, found[len(asked) :], first, max(first, end))
        return first, found[: len(asked)], longest

    def allocated(
        self, req_id: str, num_external_tokens: int, block_ids: Sequence[int] = ()
    ) -> None:
        """vLLM allocated blocks for ``num_external_tokens`` of the hit (0: it loads nothing).
        With ``async_loads``, ``block_ids`` is the request's whole block table: the load is
        planned now (vLLM runs the request only once it is in), ``take_async_loads`` hands it
        to the next step."""
        hit = self._hits.pop(req_id, None)
        if hit is None or num_external_tokens <= 0:
            return
        cb = self.chunk_blocks
        held = hit.first * cb + hit.skip  # blocks in vLLM's own cache
        reach = held * self.block_size + num_external_tokens
        end = min(hit.first + hit.chunks, reach // self.chunk_tokens)
        tail_end = (hit.first + hit.chunks) * self.chunk_tokens + hit.tail * self.block_size
        tail = hit.tail if reach >= tail_end else 0  # the tail only after every chunk before it
        first = max(hit.first, self.grid.window_chunk(end))
        if end <= first and not tail:
            return
        skip = max(0, held - first * cb)
        if not self.async_loads:
            self._loads[req_id] = Hit(first, end - first, skip, tail)
            return
        t = self._tracked[req_id]
        t.block_ids = list(block_ids)
        self._async_loads.append(self._transfer(req_id, t, t.block_hashes(), first, end, skip=skip))
        t.stored_chunks = max(t.stored_chunks, end)

    @property
    def async_loads(self) -> bool:
        """Whether loads are asynchronous for vLLM (by default with a sliding window): it runs a
        request only once its load is in, and a failed one is recomputed from its first token."""
        return self._async

    def take_async_loads(self) -> list[Transfer]:
        """The asynchronous loads planned since the last call."""
        out, self._async_loads = self._async_loads, []
        return out

    def load_failed(self, req_id: str) -> None:
        """The asynchronous load of ``req_id`` failed: vLLM computes the request from its first
        token, so its later lookups find nothing and its chunks are saved again."""
        t = self._tracked.get(req_id)
        if t is not None:
            t.load_failed, t.stored_chunks, t.answer = True, 0, None

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
            t.answer = None  # scheduled: a later lookup (after a preemption) asks afresh
            if replace:
                t.block_ids = list(block_ids or ())
            elif block_ids:
                t.block_ids.extend(block_ids)
            hashes = t.block_hashes()
            if replace:  # scheduled afresh: ``computed`` tokens came from vLLM's cache or a load
                t.stored_chunks = self._seen_end(hashes, t.stored_chunks, computed)
            load = self._loads.pop(req_id, None)
            if load is not None:
                end = load.first + load.chunks
                loads.append(
                    self._transfer(
                        req_id, t, hashes, load.first, end, skip=load.skip, tail=load.tail
                    )
                )
                t.stored_chunks = max(t.stored_chunks, end)
            ended = min(computed + scheduled_tokens, t.prompt_tokens)
            if self._save_generated:  # generated tokens' KV, once their tokens are final
                ended = max(ended, computed)
            done = min(
                ended // self.chunk_tokens,
                len(hashes) // self.chunk_blocks,
                len(t.block_ids) // self.chunk_blocks,
            )
            first = self._savable(t, computed, done)
            if done > first and self._save:
                saves.append(self._transfer(req_id, t, hashes, first, done))
                self._seen.add(saves[-1].hashes)
            elif done > first:
                self._unsaved += done - first
            t.stored_chunks = max(t.stored_chunks, done)
            if self._tails and self._save and computed < t.prompt_tokens <= ended:
                saves += self._tail_saves(req_id, t, hashes)
        return loads, saves

    def _tail_saves(self, req_id: str, t: RequestState, hashes: Sequence[bytes]) -> list[Transfer]:
        """The saves of a completed prompt's tails (see the module's docstring): of its whole
        blocks (what a longer prompt hits) and, where its last block is whole, of all but that
        one (what the same prompt hits: never its last token); none that ends a chunk, or was
        seen in the pool recently."""
        full = min(t.prompt_tokens // self.block_size, len(hashes), len(t.block_ids))
        out = []
        for end in sorted({full, min(full, (t.prompt_tokens - 1) // self.block_size)}):
            chunk, blocks = divmod(end, self.chunk_blocks)
            key = self.grid.tail_hash(hashes, chunk, blocks) if blocks and chunk else None
            if key is None or self._seen.recent(key):
                continue
            self._seen.add((key,))
            ids = self.grid.tail_block_ids(t.block_ids, chunk, blocks)
            preceding = self.chunk_hashes(hashes, 0, chunk)
            out.append(Transfer(req_id, (key,), ids, chunk, preceding, self.group, blocks))
        return out

    def take_unsaved_chunks(self) -> int:
        """The chunks a planner that does not save would have saved, since the last call."""
        out, self._unsaved = self._unsaved, 0
        return out

    def _savable(self, t: RequestState, computed: int, done: int) -> int:
        """The first chunk from ``t.stored_chunks`` whose blocks vLLM still holds in a step
        after ``computed`` tokens: a sliding window may have dropped those of earlier chunks
        (the null block in their place; the block ids the planner knows may belong to another
        request by now)."""
        cb = self.chunk_blocks
        first = max(t.stored_chunks, -(-self.grid.dropped_blocks(computed) // cb))
        # vLLM's own sliding-window hit pads nulls up to a window without the tokens it
        # retains beyond (``window`` counts them), so its table may hold a null after these
        while (
            self.window
            and first < done
            and NULL_BLOCK in t.block_ids[first * cb : (first + 1) * cb]
        ):
            first += 1
        return first

    def forget_pool(self) -> None:
        """The pool may have lost what it held (it restarted, or could not be reached): forget
        the chunks seen in it, so that those vLLM's cache holds are saved again at their next
        hit, and ask the pool afresh for every waiting request."""
        self._seen.clear()
        for t in self._tracked.values():
            t.answer = None

    @property
    def seen(self) -> SeenChunks:
        """The chunk hashes remembered as seen in the pool."""
        return self._seen

    def _seen_end(self, hashes: Sequence[bytes], first: int, computed: int) -> int:
        """The end of the run of chunks from ``first``, within the ``computed`` tokens, that
        were seen in the pool recently: they need no save."""
        end = min(computed // self.chunk_tokens, len(hashes) // self.chunk_blocks)
        c = first
        while c < end and self._seen.recent(self.grid.chunk_hash(hashes, c)):
            c += 1
        return c

    def finished(self, req_id: str) -> None:
        for table in (self._tracked, self._hits, self._loads):
            table.pop(req_id, None)

    @property
    def tracked(self) -> int:
        return len(self._tracked)

    def _transfer(
        self,
        req_id: str,
        t: RequestState,
        hashes: Sequence[bytes],
        first: int,
        end: int,
        *,
        skip: int = 0,
        tail: int = 0,
    ) -> Transfer:
        """Chunks ``[first, end)`` of a request and their blocks, and the ``tail`` first blocks of
        chunk ``end`` (its tail object, ``SKIP_BLOCK`` past them); the first ``skip`` blocks, and
        with a sliding window vLLM's null block, as ``SKIP_BLOCK`` (only loads have any)."""
        cb = self.chunk_blocks
        blocks = t.block_ids[first * cb : end * cb + tail]
        if self.window:
            blocks = [SKIP_BLOCK if b == NULL_BLOCK else b for b in blocks]
        keys = self.chunk_hashes(hashes, first, end)
        if tail:
            blocks = [*blocks, *(SKIP_BLOCK,) * (cb - tail)]
            keys += (self.grid.tail_hash(hashes, end, tail),)
        return Transfer(
            req_id,
            keys,
            (SKIP_BLOCK,) * skip + tuple(blocks[skip:]),
            first,
            self.chunk_hashes(hashes, 0, first),
            self.group,
            tail,
        )
