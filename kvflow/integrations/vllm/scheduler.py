"""KVFlowConnectorScheduler: the connector's scheduler side, in vLLM's engine-core process.

It decides hits and plans each step's transfers, and moves no bytes: per waiting request, one
batched pool lookup of the request's own block hashes, for every tensor-parallel rank at once
(``get_num_new_matched_tokens``); per step, the loads and saves of every scheduled request
(``build_connector_meta``), planned by ``planner.ChunkPlanner``, for the workers; with several KV
cache groups (vLLM's hybrid KV cache manager), one planner per group (``groups.GroupPlanner``).
With a sliding window or several groups the loads are asynchronous for vLLM: planned when it
allocates the blocks (``update_state_after_alloc``), and a request whose load a worker reports
failed (``update_connector_output``) is computed whole, with no hit again. A pool that could
not be reached, or that restarted since the last lookup (its ``contents_epoch`` changed), may
have lost what it held: the planner forgets what it saw in it (``forget_pool``, once an
outage: the lookups that fail after the first leave the answers they gave to be reused), so
that the chunks vLLM's own cache serves are saved again instead of recomputed once vLLM evicts
them.

Concurrency: vLLM calls it from its scheduler loop, one thread. A lookup runs on a helper
thread and is waited for at most ``lookup_timeout_s``: a lookup that fails or times out is a
miss, and while one that timed out still runs the next ones miss at once (no second thread).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow import trace
from kvflow.bounded import BoundedCaller
from kvflow.errors import StoreUnavailableError
from kvflow.integrations.vllm.groups import GroupPlanner
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
from kvflow.integrations.vllm.metrics import KVFlowConnectorStats, StatsInterval
from kvflow.integrations.vllm.planner import ChunkPlanner
from kvflow.integrations.vllm.pools import open_pool

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvflow.integrations.vllm.caches import CacheGroup
    from kvflow.integrations.vllm.config import ConnectorConfig

__all__ = ["KVFlowConnectorScheduler"]

log = logging.getLogger("kvflow")


class KVFlowConnectorScheduler:
    """The scheduler side of ``KVFlowConnector``: the pool lookups and the step plans."""

    def __init__(
        self,
        config: ConnectorConfig,
        groups: Sequence[CacheGroup],
        kv_role: str = "kv_both",
        forward_only_writes: bool = False,
    ) -> None:
        """``forward_only_writes``: vLLM writes a step's new blocks only in its forward
        (``support.blocks_written_in_forward_only``), so that a step's save may run on into
        the next (``config.save_across_steps``); never on a ``kv_producer``, nor with a
        sliding window (vLLM frees a running request's blocks as its window moves on, which
        no plan names)."""
        self.config = config
        windowed = any(group.window for group in groups)
        self._across = (
            config.save_across_steps
            and forward_only_writes
            and kv_role != "kv_producer"
            and not windowed
        )
        self._one_token: set[str] = set()  # requests of one output token: saves end in-step
        self.group = groups[0]
        saves = config.saves_as(kv_role)
        log.info(
            "kvflow: %s: %s%s",
            kv_role,
            "looks up and loads" if config.load else "loads nothing",
            (", saves generated chunks too" if config.save_decode_cache else ", saves prompts")
            if saves
            else ", saves nothing",
        )
        self._store = open_pool(config, scheduler=True)
        ranks = [0] if self.group.mla else list(range(self.group.tp_size))
        # per group, its keys on every rank
        self._spaces = [[group.keyspace(r) for r in ranks] for group in groups]
        several = len(groups) > 1
        self._planner = GroupPlanner(
            [
                ChunkPlanner(
                    block_size=group.block_size,
                    chunk_blocks=group.chunk_blocks,
                    lookup=functools.partial(self._lookup, g),
                    load=config.load,
                    save=saves,
                    save_generated=config.save_decode_cache,
                    window=group.window,
                    async_loads=True if several else None,
                    tails=config.tail_chunks,
                    group=g,
                    # twice the chunks vLLM's cache holds: those it can serve, and recent others
                    seen_limit=2 * group.num_blocks // group.chunk_blocks,
                )
                for g, group in enumerate(groups)
            ]
        )
        self._epoch: object = None  # the pool's contents_epoch at the last lookup
        self._unreachable = False  # the last lookup found the pool unreachable
        # one helper thread; while a lookup that timed out still runs, the next ones miss at once
        self._lookups = BoundedCaller("pool lookup", config.lookup_timeout_s, refuse_late=True)
        self._stats = StatsInterval()

    def _lookup(self, group: int, hashes: list[bytes], preceding: list[bytes]) -> np.ndarray:
        """Per chunk: every rank's object of ``group`` stored. One store call for all ranks,
        bounded by ``lookup_timeout_s``; a failing pool is a miss. ``preceding``: the chunks
        before (vLLM's cache holds them), named to a pool that orders eviction by prefix."""
        if self._store is None or not hashes:
            return np.zeros(len(hashes), dtype=bool)
        spaces = self._spaces[group]
        keys = [k for space in spaces for k in space.keys(hashes)]
        lookup = self._store.lookup
        if preceding:
            context = [k for space in spaces for k in space.keys(preceding)]
            lookup = functools.partial(self._store.lookup_with_context, context=context)
        begun = trace.now() if trace.ENABLED else 0
        try:
            found = self._lookups.call("", lookup, keys)
        except Exception as exc:  # any failure of the pool is a miss, never the scheduler's
            with self._stats.update() as stats:
                stats.data["lookup_errors"] += 1
            log.warning("kvflow: pool lookup failed, counted as a miss: %r", exc)
            if isinstance(exc, StoreUnavailableError) and not self._unreachable:
                self._unreachable = True  # it may come back empty: forgotten once an outage
                self._planner.forget_pool()
            return np.zeros(len(hashes), dtype=bool)
        finally:
            if begun:
                trace.complete("lookup", begun, "scheduler", keys=len(hashes))
        self._unreachable = False
        epoch = self._store.contents_epoch()
        if epoch is not None and epoch != self._epoch:
            if self._epoch is not None:
                log.info("kvflow: the pool restarted; chunks vLLM holds are saved again")
                self._planner.forget_pool()
            self._epoch = epoch
        found = np.asarray(found, dtype=bool).reshape(len(spaces), len(hashes))
        return np.asarray(found.all(axis=0), dtype=bool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if getattr(request, "max_tokens", None) == 1:  # a prefill for another instance
            self._one_token.add(request.request_id)
        asked = self._planner.asked_tokens
        tokens = self._planner.matched_tokens(
            request.request_id,
            lambda: request.block_hashes,
            request.num_prompt_tokens,
            num_computed_tokens,
        )
        if self._planner.asked_tokens > asked:  # the pool was asked
            with self._stats.update() as stats:
                stats.record_lookup(self._planner.asked_tokens - asked, tokens)
        return tokens, tokens > 0 and self._planner.async_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids: Sequence[Sequence[int]] = ()
        if self._planner.async_loads and num_external_tokens > 0:
            block_ids = blocks.get_block_ids()  # one list per KV cache group
        self._planner.allocated(request.request_id, num_external_tokens, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' asynchronous loads that failed: vLLM recomputes those requests."""
        for req_id in connector_output.failed_recving or ():
            self._planner.load_failed(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVFlowConnectorMetadata:
        begun = trace.now() if trace.ENABLED else 0
        meta = self._build_meta(scheduler_output)
        if begun:
            loads, saves = len(meta.loads), len(meta.saves)
            trace.complete("build_connector_meta", begun, "scheduler", loads=loads, saves=saves)
        return meta

    def _build_meta(self, scheduler_output: SchedulerOutput) -> KVFlowConnectorMetadata:
        n = scheduler_output.num_scheduled_tokens
        scheduled: list[tuple[str, Any, bool, int, int]] = [
            (r.req_id, r.block_ids, True, r.num_computed_tokens, n.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            scheduled.append(
                (
                    req_id,
                    new_ids,
                    resumed,
                    cached.num_computed_tokens[i],
                    n.get(req_id, 0),
                )
            )
        loads, saves = self._planner.step(scheduled)
        unsaved = self._planner.take_unsaved_chunks()
        if unsaved:
            with self._stats.update() as stats:
                stats.data["role_unsaved_tokens"] += unsaved * self.group.chunk_tokens
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        return KVFlowConnectorMetadata(
            loads=loads,
            saves=saves,
            async_loads=self._planner.take_async_loads(),
            save_waits=not self._across or any(t.req_id in self._one_token for t in saves),
            released=frozenset(scheduler_output.finished_req_ids).union(preempted),
        )

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._planner.finished(request.request_id)
        self._one_token.discard(request.request_id)
        # its blocks are freed now: a save still reading them ends before the next forward
        return False, None

    def take_stats(self) -> KVFlowConnectorStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        if self._store is not None:
            self._store.close()
            self._store = None
