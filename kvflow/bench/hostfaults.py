"""Faults of a Mooncake pool across hosts, under load: one run per fault, for ``kvflow bench
hosts`` and the multi-host tests.

``run_fault(directory, fault)`` makes a ``Cluster`` of four hosts: the master on host 0, two
hosts giving the pool a segment each (1 and 2), and on host 3 a ``loop`` worker, an engine under
steady load that looks each prompt up, loads and checks what hits, and recomputes and saves what
does not. Once every prompt hits, the fault is made, held for ``hold_s``, and undone; the run
ends one more pass over the prompts after every prompt hit in full again (``recover_bound_s``
bounds each wait). Faults (``FAULTS``):

* ``partition_holder`` / ``partition_client``: host 1's (host 3's) cable out, then back;
* ``master_restart``: the master killed (SIGKILL), then started again at the same address;
* ``holder_killed``: every process on host 1 killed; not undone (host 2 holds the pool);
* ``slow_link``: host 1's link capped at ``rate`` both ways, then uncapped;
* ``lossy_link``: delay and loss on host 1's link (``netem``: absent from some kernels, then
  ``NetworkError``).

The summary (``summarize``) splits the requests, by when each started, into before, during
(from the fault until every prompt hit in full again) and after (the pass that followed), and
gives the chunks loaded, failed, missing and wrong, the slowest step, steps that ran past the
hard bound (hung), and the seconds from undoing the fault (making it, for a fault not undone)
to the first request that hit in full (``recovered_s``) and to the first such request of the
last prompt (``all_recovered_s``). For a dead host the first can be a prompt whose chunks all
lay on the other one; the second is the pool whole again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from kvflow.bench.cluster import Cluster
from kvflow.bench.hostload import OBJECT_BYTES
from kvflow.config import EngineConfig
from kvflow.pipeline.runtime import stop_grace

__all__ = ["FAULTS", "LOOP_ARGS", "run_fault", "step_bound", "summarize"]

FAULTS = (
    "partition_holder",
    "partition_client",
    "master_restart",
    "holder_killed",
    "slow_link",
    "lossy_link",
)
MASTER_FLAGS = ("--client_ttl=4",)  # a dead host's segment is unmounted 4 s after it went quiet
LOOP_ARGS: dict[str, Any] = {
    "prompts": list(range(12)),
    "chunks": 4,
    "timeout_s": 3.0,  # each master call
    "op_timeout_s": 5.0,  # a whole load or save
    "copy_timeout_s": 2.0,  # one layer's copy
    "pause_s": 0.02,
}
SEGMENT = "32MiB"


def step_bound(args: dict[str, Any] = LOOP_ARGS, slack_s: float = 5.0) -> float:
    """The longest a lookup, load or save of the loop may take: its request's timeout plus the
    engine's grace for a copy past its timeout (``stop_grace``: the load waits for it before
    its blocks are used again), plus slack for a loaded machine."""
    config = EngineConfig(
        op_timeout_s=float(args["op_timeout_s"]), copy_timeout_s=float(args["copy_timeout_s"])
    )
    return config.op_timeout_s + stop_grace(config) + slack_s


def _wait_progress(path: str, done: Callable[[dict[str, Any]], bool], bound: float) -> Any:
    """The loop's progress once ``done(progress)``, or None within ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                progress = json.load(f)
            if done(progress):
                return progress
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    return None


def _all_full_since(since: float) -> Callable[[dict[str, Any]], bool]:
    """Whether every prompt has hit in full in a request started at ``since`` or later."""
    prompts = len(LOOP_ARGS["prompts"])

    def done(progress: dict[str, Any]) -> bool:
        starts = progress["full_hit"].values()
        return len(starts) == prompts and min(starts) >= since

    return done


def run_fault(
    directory: str,
    fault: str,
    *,
    hold_s: float = 5.0,
    recover_bound_s: float = 90.0,
    rate: str = "20mbit",
    delay_ms: float = 20.0,
    loss: float = 0.01,
) -> dict[str, Any]:
    """One fault under load; returns ``summarize``'s dict plus the fault's times and events."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {fault!r}")
    with Cluster(4, directory, *MASTER_FLAGS, prefix=f"{fault}/") as cluster:
        holders = [
            cluster.worker(h, f"holder{h}", "holder", segment=SEGMENT, release=cluster.path("end"))
            for h in (1, 2)
        ]
        for worker in holders:
            worker.wait_ready()
        progress = cluster.path("progress")
        loop = cluster.worker(
            3, "loop", "loop", stop=cluster.path("stop"), progress=progress, **LOOP_ARGS
        )
        loop.wait_ready()
        net = cluster.net
        holder = net[1]
        made = time.time()
        if fault == "partition_holder":
            holder.partition()
        elif fault == "partition_client":
            net[3].partition()
        elif fault == "master_restart":
            cluster.kill_master()
        elif fault == "holder_killed":
            holder.kill()
        elif fault == "slow_link":
            holder.limit(rate)
        else:
            holder.impair(delay_ms=delay_ms, loss=loss)
        time.sleep(hold_s)
        undone = time.time()
        if fault == "partition_holder":
            holder.heal()
        elif fault == "partition_client":
            net[3].heal()
        elif fault == "master_restart":
            cluster.start_master()
        elif fault in ("slow_link", "lossy_link"):
            holder.unlimit()
        else:
            undone = made  # a dead host stays dead: recovery counts from its death
        recovered = _wait_progress(progress, _all_full_since(undone), recover_bound_s)
        if recovered is not None:  # then one more pass over the prompts
            more = int(recovered["requests"]) + len(LOOP_ARGS["prompts"])
            _wait_progress(progress, lambda p: int(p["requests"]) >= more, recover_bound_s)
        open(cluster.path("stop"), "w").close()
        result = loop.result(step_bound() + 60)
        open(cluster.path("end"), "w").close()
    summary = summarize(result["events"], made, undone)
    summary.update(fault=fault, hold_s=hold_s, open_sessions=result["open_sessions"])
    summary["late_sessions"] = result["late_sessions"]
    if fault == "slow_link":
        summary["rate"] = rate
    if fault == "lossy_link":
        summary.update(delay_ms=delay_ms, loss=loss)
    summary["events"] = result["events"]
    return summary


def _phase(events: list[dict[str, Any]]) -> dict[str, Any]:
    chunks = int(LOOP_ARGS["chunks"])
    loads = [e["load_s"] for e in events if "load_s" in e]
    return {
        "requests": len(events),
        "full_hits": sum(e["ok"] == chunks for e in events),
        "chunks_ok": sum(e["ok"] for e in events),
        "failed": sum(e["failed"] for e in events),
        "missing": sum(e["missing"] for e in events),
        "not_found": sum(chunks - e["hit_chunks"] for e in events),
        "mean_load_ms": round(1000 * sum(loads) / len(loads), 2) if loads else None,
    }


def _recovery(events: list[dict[str, Any]], since: float) -> tuple[float | None, float | None]:
    """When the first request started at ``since`` or later that hit in full started, and when
    the last prompt's first such request did (None: not every prompt hit in full again)."""
    chunks, prompts = int(LOOP_ARGS["chunks"]), len(LOOP_ARGS["prompts"])
    first: dict[int, float] = {}
    for e in events:
        if e["t"] >= since and e["ok"] == chunks:
            first.setdefault(e["prompt"], e["t"])
    if not first:
        return None, None
    return min(first.values()), max(first.values()) if len(first) == prompts else None


def summarize(events: list[dict[str, Any]], made: float, undone: float) -> dict[str, Any]:
    """Before the fault, during it (until every prompt hit in full again), after (the pass that
    followed), and what bounds every request (see the module)."""
    first_full, all_full = _recovery(events, undone)
    end = all_full if all_full is not None else float("inf")
    steps = [e.get(k, 0.0) for e in events for k in ("lookup_s", "load_s", "save_s")]
    settles = [e["settle_s"] for e in events if "settle_s" in e]
    return {
        "before": _phase([e for e in events if e["t"] < made]),
        "during": _phase([e for e in events if made <= e["t"] <= end]),
        "after": _phase([e for e in events if e["t"] > end]),
        "wrong_chunks": sum(e["wrong"] for e in events),
        "hung_requests": sum(bool(e["hung"]) for e in events),
        "errors": sum(len(e.get("errors", ())) for e in events),
        "stragglers_waited": len(settles),
        "longest_straggler_wait_s": round(max(settles, default=0.0), 3),
        "stopped": any(e.get("stopped") for e in events),
        "slowest_step_s": round(max(steps, default=0.0), 3),
        "step_bound_s": step_bound(),
        "recovered_s": None if first_full is None else round(first_full - undone, 3),
        "all_recovered_s": None if all_full is None else round(all_full - undone, 3),
        "chunk_bytes": OBJECT_BYTES,
    }


def without_events(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "events"}
