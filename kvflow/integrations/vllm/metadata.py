"""KVFlowConnectorMetadata: one step's plan, from the scheduler process to every worker.

vLLM pickles it into the step's ``SchedulerOutput`` (the scheduler's ``build_connector_meta``)
and binds it in each worker before the forward (``bind_connector_metadata``). It holds only
plain data: the planner's ``Transfer`` records, the same on every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvflow.integrations.vllm.planner import Transfer

__all__ = ["KVFlowConnectorMetadata"]


@dataclass
class KVFlowConnectorMetadata(KVConnectorMetadata):
    """One step's plan: the chunks to load into which blocks (``loads``), and the chunks this
    step completes, to save from which blocks (``saves``); ``async_loads``: loads to start
    now for requests vLLM runs only once they are in (one per request).

    ``save_waits``: the step's save ends within the step (``wait_for_save``), else it may run
    on into the next (``ConnectorConfig.save_across_steps``); ``released``: the requests
    whose blocks vLLM freed since the last step (finished, aborted or preempted), whose save
    must end before this step's forward may write those blocks."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    async_loads: list[Transfer] = field(default_factory=list)
    save_waits: bool = True
    released: frozenset[str] = frozenset()
