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

import json
import sys

from kvflow.integrations.vllm.scheduler import KVFlowConnectorScheduler
from kvflow.pool import PoolConfig, PoolServer
from tests.support.scheduler_steps import BLOCK, CHUNKS, finish, scheduler, step


def _saved(sched: KVFlowConnectorScheduler, prompt: str, computed: int) -> int:
    """One request of ``prompt`` scheduled after ``computed`` tokens from vLLM's cache; the
    chunks its step saved."""
    rid, meta = step(sched, prompt, computed)
    finish(sched, rid)
    return sum(len(t.hashes) for t in meta.saves)


def run(socket: str, outage: str) -> list[int]:
    servers = [PoolServer(PoolConfig(socket=socket, capacity="8MiB"))]
    servers[0].start()
    sched = scheduler(socket)
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
