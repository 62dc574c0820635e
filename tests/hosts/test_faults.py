"""Faults of a Mooncake pool across hosts, under load (``kvflow.bench.hostfaults``): an engine
on host 3 serves a steady stream of requests from segments on hosts 1 and 2 while a link goes
down, the master dies and comes back, a host dies, a link slows down. Every request returns
within its timeout plus the engine's grace, no chunk reported loaded holds a wrong byte, the
fault shows as failed or missing chunks (recomputed and saved again), every prompt hits in full
again once it is over, and the pass after that still hits. Minutes of work on this machine: the
slow tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.bench.hostfaults import FAULTS, LOOP_ARGS, run_fault, step_bound, without_events
from kvflow.testing import netns
from tests.support.hosts import require_hosts
from tests.support.pools import require_mooncake

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_under_load(fault: str, tmp_path: Path) -> None:
    require_hosts()
    require_mooncake()
    if fault == "lossy_link" and not netns.has_netem():
        pytest.skip("this kernel's tc has no netem queue: delay and loss cannot be made")
    run = without_events(run_fault(str(tmp_path), fault))
    before, during, after = run["before"], run["during"], run["after"]
    assert run["wrong_chunks"] == 0, run
    assert run["hung_requests"] == 0 and not run["stopped"], run
    assert run["slowest_step_s"] <= step_bound(), run
    assert run["recovered_s"] is not None, f"no request hit in full after the {fault}: {run}"
    assert run["all_recovered_s"] is not None, f"a prompt never hit in full again: {run}"
    # the run waits for a pass over the prompts after that: the requests are counted, not timed
    assert after["requests"] >= len(LOOP_ARGS["prompts"]), run
    assert after["full_hits"] > 0, run
    assert before["full_hits"] > 0
    assert run["open_sessions"] == 0
    felt = during["failed"] + during["missing"] + during["not_found"] + run["errors"]
    if fault in ("partition_holder", "partition_client", "master_restart", "holder_killed"):
        assert felt > 0, f"the {fault} never showed: {run}"
    if fault == "holder_killed":  # the other host's segment kept serving meanwhile
        assert during["chunks_ok"] > 0, run
    if fault == "slow_link":
        assert during["chunks_ok"] > 0, run
