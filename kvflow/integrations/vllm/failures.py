"""Steps that must not store what they computed, and must not wait for what will not come.

* A forward cut short: the model raised before its last layer, and vLLM ends the step all the
  same. Its load is dropped at once (no wait for layers that never come; every block reported
  failed) and so is its save (it holds layers of a forward that did not end).
* A load failed on any tensor-parallel rank: attention outputs are summed over the ranks, so
  the KV every rank computed in the step rests on every rank's loaded KV, and no rank's save
  of that step may be stored. The ranks agree with one all-reduce, in steps that load and save.

Concurrency: the model thread's, as the worker's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvflow.integrations.vllm.steps import Step
    from kvflow.integrations.vllm.transfers import Transfers

__all__ = ["failed_on_any_rank", "forward_cut", "stop_cut_step"]

log = logging.getLogger("kvflow")


def forward_cut(step: Step, last_layer: int, layerwise: bool) -> bool:
    """Whether the step's forward stopped before its last layer: it raised, and vLLM ends
    the step all the same. Every layer of a forward calls a hook, and only a step with
    scheduled tokens (a forward) has a load that layer waits pace."""
    if step.hooked_layer >= 0:
        return step.hooked_layer < last_layer
    return bool(step.meta.loads) and step.load is not None and layerwise


def stop_cut_step(step: Step, last_layer: int, transfers: Transfers) -> None:
    """Stop a cut step's transfers at once, without waiting for layers that will never
    come: its load is dropped (every block reported failed), its save too (it holds layers
    of a forward that did not end: never stored)."""
    log.warning(
        "kvflow: the step's forward stopped after layer %d of %d; its load and save stopped",
        step.hooked_layer,
        last_layer,
    )
    if step.load is not None:
        transfers.drop(step.load, "load")
        step.load, step.load_failed = None, True
    step.save_stopped = True  # dropped at the step's end, with the save of any failed step


def failed_on_any_rank(failed: bool, tp_size: int) -> bool:
    """Whether the step's load failed on any tensor-parallel rank (``failed``: on this one).
    One all-reduce on vLLM's CPU group of the tensor-parallel workers (bounded by its
    timeout)."""
    if tp_size == 1:
        return failed
    from vllm.distributed.parallel_state import get_tp_group

    flag = torch.tensor([int(failed)], dtype=torch.int32)
    group = get_tp_group().cpu_group
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())
