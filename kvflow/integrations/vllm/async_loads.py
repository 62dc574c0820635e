"""Asynchronous loads: a sliding window's hits (the plan's ``async_loads``, one per request).

Each starts with its step's transfers, its prefetch window lifted (no layer wait paces it),
and runs on across steps, for requests vLLM runs only once they are in. At each step's end
``finished`` reports those that ended and those that failed (vLLM then computes the request
from its first token); one still running ``op_timeout_s`` after it started is stopped and
failed. Nothing here waits for a load that is running.

Concurrency: the model thread's, as the worker's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvflow.errors import KVFlowError
from kvflow.integrations.vllm.steps import requests
from kvflow.layout import SKIP_BLOCK

if TYPE_CHECKING:
    from kvflow.integrations.vllm.planner import Transfer
    from kvflow.integrations.vllm.transfers import Transfers
    from kvflow.pipeline.sync import SyncLoadHandle

__all__ = ["AsyncLoads"]

log = logging.getLogger("kvflow")


class _AsyncLoad:
    """One request's asynchronous load: its handle (None: it could not start) and plan."""

    def __init__(self, handle: SyncLoadHandle | None, transfer: Transfer) -> None:
        self.handle = handle
        self.transfer = transfer
        self.started = time.monotonic()


class AsyncLoads:
    """The worker's asynchronous loads in flight, by request id, on its ``transfers``."""

    def __init__(self, transfers: Transfers) -> None:
        self._transfers = transfers
        self._loads: dict[str, _AsyncLoad] = {}

    def start(self, loads: Sequence[Transfer]) -> None:
        """Start the plan's asynchronous loads, each with its prefetch window lifted: no layer
        wait paces them, ``finished`` reads them in later steps."""
        for t in loads:
            handle = None
            engine = self._transfers.engine
            if engine is not None:
                try:
                    handle = engine.start_load(requests([t]))
                    handle.load_all()
                except KVFlowError as exc:
                    log.warning("kvflow: a load of %s did not start: %s", t.req_id, exc)
                    if handle is not None:  # started, then not let run: stopped, and failed
                        self._transfers.drop(handle, "asynchronous load")
                    handle = None
            self._loads[t.req_id] = _AsyncLoad(handle, t)

    def finished(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous load ended since the last call, and of those the
        ones whose load failed (any block: vLLM computes them from the first token). A load
        still running ``op_timeout_s`` after it started is stopped and failed; nothing else
        here waits."""
        finished: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        transfers = self._transfers
        for req_id, load in list(self._loads.items()):
            handle = load.handle
            running = handle is not None and not handle.done()
            if running and now - load.started < transfers.config.op_timeout_s:
                continue
            del self._loads[req_id]
            finished.add(req_id)
            if handle is None:
                result = None
            elif running:
                log.warning("kvflow: the load of %s is late; stopped", req_id)
                transfers.drop(handle, "load")
                result = None
            else:
                result = transfers.result(handle, "load")  # out already: no wait
            planned = np.asarray(load.transfer.block_ids, dtype=np.int64)
            if transfers.load_failures(result, planned[planned != SKIP_BLOCK]).size:
                failed.add(req_id)
        return finished, failed

    def close(self) -> None:
        """Stop every load in flight (at shutdown), without waiting for them."""
        for load in self._loads.values():
            if load.handle is not None:
                load.handle.close()
        self._loads.clear()
