"""Several KV cache groups (vLLM's hybrid KV cache manager), on the scheduler side, without vLLM.

vLLM's hybrid KV cache manager gives each kind of attention layer of a model its own group (as
Gemma 2's sliding-window and full-attention layers): the group's layers, its attention spec and
its own block table per request, from one block pool. ``GroupPlanner`` runs one
``planner.ChunkPlanner`` per group: its keys name the group (other layers, other objects), its
lookups, hits, loads and saves follow the group's own rules (a prefix run with full attention,
the window's chunks with a sliding window), into the group's block ids, with the group's null
blocks skipped. A request's hit is the longest chunk end that is a hit in every group (the
groups share vLLM's block hashes, so their chunks end at the same tokens).

With several groups every load is asynchronous for vLLM: it runs a request once every group's
load is in, and recomputes it from its first token when any failed. A step's save then never
rests on a load of the same step, in any group.

With one group it is that group's planner, call for call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.integrations.vllm.planner import ChunkPlanner, Transfer

__all__ = ["GroupPlanner"]

# per request: (req_id, block ids per group (all of them when ``replace``, else the new ones,
# or None), replace, tokens computed before the step, tokens scheduled in it)
Scheduled = tuple[str, Sequence[Sequence[int]] | None, bool, int, int]


class GroupPlanner:
    """One ``ChunkPlanner`` per KV cache group (``planners[g]``: group ``g``'s, every one with
    the same chunk tokens), and the request-wide decisions: the hit every group has, and the
    requests to forget. Not thread-safe: vLLM calls the scheduler side from one thread, and
    each group's lookup is one bounded pool call (so a request's lookup waits at most the
    groups' number of ``lookup_timeout_s``)."""

    def __init__(self, planners: Sequence[ChunkPlanner]) -> None:
        assert planners, "no KV cache group"
        assert len({p.chunk_tokens for p in planners}) == 1, "groups with other chunk sizes"
        self.planners = list(planners)
        self.chunk_tokens = planners[0].chunk_tokens

    @property
    def asked_tokens(self) -> int:
        """The tokens the pool was asked about, so far (every group asks for the same ones)."""
        return self.planners[0].asked_tokens

    @property
    def async_loads(self) -> bool:
        return any(p.async_loads for p in self.planners)

    def matched_tokens(
        self,
        req_id: str,
        block_hashes: Callable[[], Sequence[bytes]],
        prompt_tokens: int,
        num_computed: int,
    ) -> int:
        """The tokens beyond ``num_computed`` every group's planner can provide: each group is
        asked once, then held to the shortest answer until all agree on a chunk end that is a
        hit in each (a window's hit may need chunks a shorter end's window does not)."""
        limit: int | None = None
        while True:
            tokens = min(
                p.matched_tokens(req_id, block_hashes, prompt_tokens, num_computed, limit)
                for p in self.planners
            )
            end = (num_computed + tokens) // self.chunk_tokens
            if tokens == 0 or end == limit or len(self.planners) == 1:
                break
            limit = end
        return tokens

    def allocated(
        self, req_id: str, num_external_tokens: int, block_ids: Sequence[Sequence[int]] = ()
    ) -> None:
        """vLLM allocated the request's blocks (``block_ids[g]``: group ``g``'s table)."""
        for g, p in enumerate(self.planners):
            p.allocated(req_id, num_external_tokens, block_ids[g] if block_ids else ())

    def take_async_loads(self) -> list[Transfer]:
        return [t for p in self.planners for t in p.take_async_loads()]

    def load_failed(self, req_id: str) -> None:
        for p in self.planners:
            p.load_failed(req_id)

    def step(self, scheduled: Sequence[Scheduled]) -> tuple[list[Transfer], list[Transfer]]:
        """One scheduler step (see ``ChunkPlanner.step``), each group with its own block ids."""
        loads: list[Transfer] = []
        saves: list[Transfer] = []
        for g, p in enumerate(self.planners):
            group_loads, group_saves = p.step(
                [
                    (req_id, None if ids is None else ids[g], replace, computed, n)
                    for req_id, ids, replace, computed, n in scheduled
                ]
            )
            loads += group_loads
            saves += group_saves
        return loads, saves

    def take_unsaved_chunks(self) -> int:
        """Chunks the first group would have saved (every group's chunks end at the same
        tokens)."""
        unsaved = [p.take_unsaved_chunks() for p in self.planners]
        return unsaved[0]

    def finished(self, req_id: str) -> None:
        for p in self.planners:
            p.finished(req_id)

    def forget_pool(self) -> None:
        for p in self.planners:
            p.forget_pool()

    @property
    def tracked(self) -> int:
        return self.planners[0].tracked
