"""The worker's engine and how its transfers end: a result waited for (within
``op_timeout_s``), a transfer dropped, the blocks a load did not bring (counted, and reported
to vLLM), a save's chunks counted.

A save may be left to end beside the next step (``finish_save(..., wait=False)``: one at a
time, ``save_across_steps``); it is waited for and counted by ``end_unfinished``, at the next
step's start when vLLM freed a block it reads (its request in the plan's ``released``) or the
step loads (``before_forward``), else at the next step's end, and before the engine closes.

A dropped transfer is closed with ``close(wait=True)``, which returns once none of its copies
runs any more: vLLM reuses the blocks when the step ends. A load whose result came while a copy
that ran past its timeout still runs is dropped the same way before its result is used. A
copy still running past the engine's grace (``kvflow.pipeline.runtime.stop_grace``) stops the
worker's transfers for good (``engine`` becomes None): vLLM may reuse the blocks it would
touch.

Concurrency: a ``Transfers`` belongs to its worker and is called from the model thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvflow.errors import KVFlowError
from kvflow.results import ChunkStatus, TransferResult

if TYPE_CHECKING:
    from kvflow.integrations.vllm.caches import CacheGroup
    from kvflow.integrations.vllm.config import ConnectorConfig
    from kvflow.integrations.vllm.metrics import StatsInterval
    from kvflow.integrations.vllm.planner import Transfer
    from kvflow.pipeline.sync import SyncLoadHandle, SyncSaveHandle, SyncTransferEngine

__all__ = ["Transfers"]

log = logging.getLogger("kvflow")


@dataclass(frozen=True)
class _Unfinished:
    """A save left to end beside the next step: its handle, its plan (in its order), the
    layers it had still to copy when its step ended, and its requests."""

    handle: SyncSaveHandle
    transfers: Sequence[Transfer]
    backlog: int
    requests: frozenset[str]


class Transfers:
    """One worker's engine (None: no pool, or stopped for good) and the ends of its
    transfers, counted in the worker's ``stats``."""

    def __init__(self, config: ConnectorConfig, group: CacheGroup, stats: StatsInterval) -> None:
        self.config = config
        self.group = group
        self.engine: SyncTransferEngine | None = None
        self._stopped: SyncTransferEngine | None = None  # stopped for good, closed at close()
        self.block_bytes = 0  # one block, every layer
        self.debug_here = True  # the debug hooks act in this worker (config.debug_rank)
        self._stats = stats
        self._unfinished: _Unfinished | None = None

    def result(
        self, handle: SyncLoadHandle | SyncSaveHandle | None, what: str
    ) -> TransferResult | None:
        """The transfer's result; None (the transfer dropped) when it does not come in time.

        A result comes out at once even while a copy that ran past its timeout still runs (its
        chunks failed). A load's such copy may still write its blocks, which vLLM then
        recomputes, frees or hands on: the load is dropped too (waited for, within the engine's
        grace) before its result is returned. (A save's only reads them, and its chunk is
        aborted when it returns.)"""
        if handle is None:
            return None
        try:
            result = handle.wait(timeout=self.config.op_timeout_s)
        except KVFlowError as exc:
            log.warning("kvflow: the step's %s did not finish: %s", what, exc)
            self.drop(handle, what)
            return None
        if what == "load" and not handle.done():  # a straggler: the blocks are not vLLM's yet
            log.warning("kvflow: the step's %s has a copy past its timeout; waiting for it", what)
            self.drop(handle, what)
        return result

    def drop(self, handle: SyncLoadHandle | SyncSaveHandle, what: str) -> None:
        """Abort a transfer and wait until no copy of it can still touch the blocks (a copy past
        its timeout may still be running): vLLM reuses them once the step ends. If one is still
        running after the engine's grace, the connector stops moving bytes for good."""
        try:
            ended = handle.close(wait=True)
        except KVFlowError as exc:  # the engine is closed: what it left is all there is
            log.warning("kvflow: closing the step's %s: %s", what, exc)
            ended = handle.done()
        if not ended and self.engine is not None:  # else it stopped already: keep that one
            log.critical(
                "kvflow: a %s copy is still running past its grace; the connector stops "
                "loading and saving in this process",
                what,
            )
            self._stopped, self.engine = self.engine, None

    def close(self) -> None:
        """End a save left unfinished, then close the engine, and one stopped for good (its
        threads and loop, once its straggler has returned or its grace has run out)."""
        self.end_unfinished()
        for engine in (self.engine, self._stopped):
            if engine is not None:
                engine.close()
        self.engine = self._stopped = None

    def finish_save(
        self, handle: SyncSaveHandle, transfers: Sequence[Transfer], wait: bool = True
    ) -> None:
        """Wait for a save's result and count it (``transfers``: the save's, in its order; a
        tail counts its own blocks' tokens, and a whole chunk's bytes: its padding is copied).
        Without ``wait`` it is left to end on its own, once an earlier one left so has been
        waited for (``end_unfinished``)."""
        backlog = handle.handle.backlog  # layers still to copy (it opened: layers came)
        self.end_unfinished()
        if wait:
            self._count_save(handle, transfers, backlog)
            return
        requests = frozenset(t.req_id for t in transfers)
        self._unfinished = _Unfinished(handle, transfers, backlog, requests)

    def before_forward(self, released: Collection[str], loads: bool) -> None:
        """A step's start: end the save left unfinished if the step's forward may write a
        block it reads (its request among ``released``, whose blocks vLLM freed) or the step
        ``loads`` (the load's copies would queue behind the save's, their timeouts running)."""
        left = self._unfinished
        if left is not None and (loads or not left.requests.isdisjoint(released)):
            self.end_unfinished()

    def end_unfinished(self) -> None:
        """Wait for the save left unfinished, if any, and count it."""
        left, self._unfinished = self._unfinished, None
        if left is not None:
            self._count_save(left.handle, left.transfers, left.backlog)

    def _count_save(
        self, handle: SyncSaveHandle, transfers: Sequence[Transfer], backlog: int
    ) -> None:
        result = self.result(handle, "save")
        with self._stats.update() as stats:
            d = stats.data
            d["saves"] += 1
            stats.record_save_backlog(backlog)
            if result is None:
                return
            statuses = [r.chunk_status for r in result.requests]
            counts = [len(s) for s in statuses]
            blocks = np.full(sum(counts), self.group.chunk_blocks)
            ends = np.cumsum(counts) - 1  # each request's last chunk
            for t, end, n in zip(transfers, ends, counts, strict=True):
                if t.tail and n:
                    blocks[end] = t.tail  # a tail's own blocks, not its padding
            tokens = self.group.block_size * np.bincount(  # by status
                np.concatenate(statuses) if statuses else [], blocks, len(ChunkStatus)
            )
            d["saved_tokens"] += int(tokens[ChunkStatus.OK])
            d["saved_bytes"] += (
                result.count(ChunkStatus.OK) * self.group.chunk_blocks * self.block_bytes
            )
            skipped = tokens[ChunkStatus.EXISTS] + tokens[ChunkStatus.NO_SPACE]
            d["save_skipped_tokens"] += int(skipped)
            d["save_failed_tokens"] += int(tokens[ChunkStatus.FAILED])
            d["save_failed_chunks"] += result.count(ChunkStatus.FAILED)

    def load_failures(self, result: TransferResult | None, planned: np.ndarray) -> np.ndarray:
        """The ``planned`` blocks of an ended load that failed, counted in the stats: all of
        them without a result (or with ``debug_fail_loads``), else those the result names
        (``debug_corrupt_loads`` then garbles the others)."""
        if result is None or (self.config.debug_fail_loads and self.debug_here):
            failed = planned
        else:
            failed = result.failed_block_ids
            if self.config.debug_corrupt_loads and self.debug_here:
                self._corrupt(planned[~np.isin(planned, failed)])
        with self._stats.update() as stats:
            d = stats.data
            d["loads"] += 1
            d["loaded_tokens"] += (len(planned) - len(failed)) * self.group.block_size
            d["loaded_bytes"] += (len(planned) - len(failed)) * self.block_bytes
            d["load_failed_tokens"] += len(failed) * self.group.block_size
            d["load_failed_chunks"] += -(-len(failed) // self.group.chunk_blocks)
        return failed

    def _corrupt(self, blocks: np.ndarray) -> None:
        """Test hook (``debug_corrupt_loads``): overwrite loaded blocks with garbage."""
        assert self.engine is not None
        layout = self.engine.layout
        if layout.device != "cpu":
            log.warning("kvflow: debug_corrupt_loads works on CPU caches only; ignored")
            return
        for parts in layout.layers:
            for part in parts:
                for block in blocks.tolist():
                    ctypes.memset(part.base + block * part.block_stride, 0x7B, part.block_bytes)
