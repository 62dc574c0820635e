"""KVFlowConnectorScheduler through a pool outage, without vLLM's engine. The scheduler side
imports vLLM, so this runs in vLLM's interpreter:

    $KVFLOW_VLLM_PYTHON -m tests.support.scheduler_outage SOCKET restarted|unreachable

and prints, as JSON, the chunks each scheduler step saved. vLLM's request and scheduler output
are stand-ins with the fields the scheduler reads; the pool is a real server on threads of this
process. Request ``computed`` prompts compute all four chunks of a prompt; ``held`` ones have
the same prompt with every chunk in vLLM's own cache, so a step saves only the chunks the
planner thinks the pool lacks. The steps: ``A`` computed, ``A`` held, ``B`` computed (a lookup
on the same pool), ``A`` held; then the server stops, and either a new one starts on the same
socket (``restarted``) or none does (``unreachable``); then ``B`` computed (its lookup meets
the outage), ``A`` held, ``A`` held, ``B`` computed (a second lookup in the same outage: the
planner forgets once), ``A`` held.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from types import SimpleNamespace

from kvflow.integrations.vllm.caches import CacheGroup
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.scheduler import KVFlowConnectorScheduler
from kvflow.pool import PoolConfig, PoolServer

BLOCK = 16  # tokens per block, one block per chunk
CHUNKS = 4
PROMPT = CHUNKS * BLOCK + 1  # the last token is always computed
_ids = itertools.count()


def _hashes(name: str) -> list[bytes]:
    return [hashlib.sha256(f"{name} {i}".encode()).digest() for i in range(CHUNKS)]


def _saved(sched: KVFlowConnectorScheduler, prompt: str, computed: int) -> int:
    """One request of ``prompt`` scheduled after ``computed`` tokens from vLLM's cache; the
    chunks its step saved."""
    rid = f"r{next(_ids)}"
    req = SimpleNamespace(request_id=rid, block_hashes=_hashes(prompt), num_prompt_tokens=PROMPT)
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
    )
    meta = sched.build_connector_meta(output)  # type: ignore[arg-type]
    sched.request_finished(req)  # type: ignore[arg-type]
    return sum(len(t.hashes) for t in meta.saves)


def run(socket: str, outage: str) -> list[int]:
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
    )
    shared = {"socket": socket, "auto_start": False, "retry_interval_s": 0.05, "timeout_s": 60}
    servers = [PoolServer(PoolConfig(socket=socket, capacity="8MiB"))]
    servers[0].start()
    sched = KVFlowConnectorScheduler(ConnectorConfig(store="shared", shared=shared), [group])
    held = CHUNKS * BLOCK
    try:
        steps = [_saved(sched, "A", 0), _saved(sched, "A", held)]
        steps += [_saved(sched, "B", 0), _saved(sched, "A", held)]
        servers[0].stop()
        if outage == "restarted":
            servers.append(PoolServer(PoolConfig(socket=socket, capacity="8MiB")))
            servers[-1].start()
        steps += [_saved(sched, "B", 0), _saved(sched, "A", held), _saved(sched, "A", held)]
        return [*steps, _saved(sched, "B", 0), _saved(sched, "A", held)]
    finally:
        sched.shutdown()
        for server in servers:
            server.stop()


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])))
