"""KVFlowConnectorScheduler driven step by step without vLLM's engine, on a real pool server
on threads of this process. The scheduler side imports vLLM, so this runs in vLLM's
interpreter; vLLM's request and scheduler output are stand-ins with the fields the scheduler
reads. Used by ``scheduler_outage`` and, as a script, for the plans' save ends:

    $KVFLOW_VLLM_PYTHON -m tests.support.scheduler_steps SOCKET

prints, as JSON, per scenario the steps' ``[save_waits, sorted(released)]``: on ``kv_both``
with ``save_across_steps``, a request's step; the next step after vLLM finished it and
preempted another; a request of one output token's step; and the same first step on a
``kv_producer``, without ``save_across_steps``, and with a sliding window.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import sys
from collections.abc import Collection, Iterator
from types import SimpleNamespace
from typing import Any

from kvflow.integrations.vllm.caches import CacheGroup
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
from kvflow.integrations.vllm.scheduler import KVFlowConnectorScheduler
from kvflow.pool import PoolConfig, PoolServer

__all__ = ["BLOCK", "CHUNKS", "PROMPT", "finish", "running", "scheduler", "step"]

BLOCK = 16  # tokens per block, one block per chunk
CHUNKS = 4
PROMPT = CHUNKS * BLOCK + 1  # the last token is always computed
_ids = itertools.count()


def _hashes(name: str) -> list[bytes]:
    return [hashlib.sha256(f"{name} {i}".encode()).digest() for i in range(CHUNKS)]


def scheduler(
    socket: str, window: int = 0, across: bool = True, **kwargs: Any
) -> KVFlowConnectorScheduler:
    """A scheduler of one group (one block a chunk; ``window``: its sliding window's tokens)
    on the pool at ``socket``, never started by it, in a vLLM that writes new blocks only in
    the forward (``across``: the connector's ``save_across_steps``; ``kwargs``: the
    scheduler's own, after its config and groups)."""
    group = CacheGroup(
        spec=None,
        block_size=BLOCK,
        num_blocks=64,
        num_layers=2,
        mla=False,
        tp_size=1,
        chunk_blocks=1,
        model="m",
        fingerprint="f",
        window=window,
    )
    shared = {"socket": socket, "auto_start": False, "retry_interval_s": 0.05, "timeout_s": 60}
    config = ConnectorConfig(store="shared", shared=shared, save_across_steps=across)
    return KVFlowConnectorScheduler(config, [group], forward_only_writes=True, **kwargs)


@contextlib.contextmanager
def running(socket: str, **kwargs: Any) -> Iterator[KVFlowConnectorScheduler]:
    """``scheduler(socket, **kwargs)`` on a new pool server; both stopped at the end."""
    server = PoolServer(PoolConfig(socket=socket, capacity="8MiB"))
    server.start()
    sched = scheduler(socket, **kwargs)
    try:
        yield sched
    finally:
        sched.shutdown()
        server.stop()


def step(
    sched: KVFlowConnectorScheduler,
    prompt: str,
    computed: int = 0,
    *,
    max_tokens: int = 8,
    finished: Collection[str] = (),
    preempted: Collection[str] = (),
) -> tuple[str, KVFlowConnectorMetadata]:
    """One new request of ``prompt`` scheduled after ``computed`` tokens from vLLM's cache,
    whole, in a step after vLLM ``finished`` and ``preempted`` those requests: its id and the
    step's plan."""
    rid = f"r{next(_ids)}"
    req = SimpleNamespace(
        request_id=rid,
        block_hashes=_hashes(prompt),
        num_prompt_tokens=PROMPT,
        max_tokens=max_tokens,
    )
    matched, _ = sched.get_num_new_matched_tokens(req, computed)  # type: ignore[arg-type]
    assert matched == 0, matched  # nothing is ever written into the pool here
    new = SimpleNamespace(
        req_id=rid, block_ids=(list(range(CHUNKS + 1)),), num_computed_tokens=computed
    )
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    output = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: PROMPT - computed},
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )
    return rid, sched.build_connector_meta(output)  # type: ignore[arg-type]


def finish(sched: KVFlowConnectorScheduler, rid: str) -> None:
    """vLLM finished request ``rid``."""
    sched.request_finished(SimpleNamespace(request_id=rid))  # type: ignore[arg-type]


def save_ends(socket: str) -> dict[str, list[list[Any]]]:
    """Per scenario (the module's), its steps' ``[save_waits, sorted(released)]``."""

    def shown(meta: KVFlowConnectorMetadata) -> list[Any]:
        assert meta.saves  # every step here saves its prompt's chunks
        return [meta.save_waits, sorted(meta.released)]

    out: dict[str, list[list[Any]]] = {}
    with running(socket, kv_role="kv_both") as sched:
        first, meta = step(sched, "A")
        other, _ = step(sched, "B")
        finish(sched, first)
        _, after = step(sched, "C", finished=[first], preempted=[other])
        one, single = step(sched, "D", max_tokens=1)
        finish(sched, one)
        out["kv_both"] = [shown(meta), shown(after), shown(single)]
    for name, kwargs in (
        ("kv_producer", {"kv_role": "kv_producer"}),
        ("not_across", {"kv_role": "kv_both", "across": False}),
        ("windowed", {"kv_role": "kv_both", "window": 2 * BLOCK}),
    ):
        with running(socket, **kwargs) as sched:
            out[name] = [shown(step(sched, "A")[1])]
    return out


if __name__ == "__main__":
    print(json.dumps(save_ends(sys.argv[1])))
