"""One step of the worker: its plan, the transfers started from it, and how far it got.

The worker makes a ``Step`` from the scheduler's plan when vLLM binds it (before the forward),
starts its load and save at the step's first hook (``start_transfer``), records in it what the
forward reached, and ends it at ``wait_for_save`` (or when vLLM clears it). Not thread-safe:
only the model thread touches a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvflow import trace
from kvflow.errors import KVFlowError
from kvflow.keys import ChunkHashes
from kvflow.layout import SKIP_BLOCK
from kvflow.pipeline.sync import SyncLoadHandle, SyncSaveHandle

if TYPE_CHECKING:
    from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
    from kvflow.integrations.vllm.planner import Transfer

__all__ = ["Step", "requests", "start_transfer"]

log = logging.getLogger("kvflow")

H = TypeVar("H", SyncLoadHandle, SyncSaveHandle)


class Step:
    """The worker's state for one step: its plan, and the transfers started from it."""

    def __init__(self, meta: KVFlowConnectorMetadata) -> None:
        self.meta = meta
        self.load: SyncLoadHandle | None = None
        self.save: SyncSaveHandle | None = None
        self.load_started = False
        self.load_failed = False  # some block of the load is lost (all, before its result)
        self.save_stopped = False
        self.save_written = False  # some layer reached the save (else the step had no forward)
        self.held_layer: int | None = None  # the last layer, held from the save (see _end_step)
        self.hooked_layer = -1  # the last layer the forward reached (a per-layer hook came)
        self.ended = False
        self.ident = id(self)  # the trace's id of the step's load and save spans

    def planned_loads(self) -> np.ndarray:
        """The blocks the step's load writes (``SKIP_BLOCK`` places left out)."""
        every = [np.asarray(t.block_ids, dtype=np.int64) for t in self.meta.loads]
        planned = np.concatenate(every) if every else np.zeros(0, np.int64)
        kept: np.ndarray = planned[planned != SKIP_BLOCK]
        return kept


def requests(transfers: Sequence[Transfer]) -> list[tuple[ChunkHashes, np.ndarray]]:
    """The engine's requests for the plan's ``transfers``: chunk hashes and their blocks."""
    return [(ChunkHashes(t.hashes, t.preceding), np.asarray(t.block_ids)) for t in transfers]


def start_transfer(
    step: Step, what: str, transfers: Sequence[Transfer], start: Callable[..., H]
) -> H | None:
    """Start the step's load or save of ``transfers`` (``start``: the engine's
    ``start_load`` or ``start_save``); None (logged) when it cannot start."""
    batch = requests(transfers)
    if trace.ENABLED:
        trace.async_begin(f"step_{what}", step.ident, "step", requests=len(batch))
    try:
        return start(batch)
    except KVFlowError as exc:
        log.warning("kvflow: the step's %s did not start: %s", what, exc)
        return None
