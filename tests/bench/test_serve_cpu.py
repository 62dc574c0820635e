"""The serving benchmarks' CPU accounting (``tests.support.serve.cpu_by_role``): a process
group's CPU time per ``vllm serve`` role, told by the title vLLM gives each process, read from
``/proc``. The processes here stand in for vLLM's (their ``argv[0]`` is the title vLLM sets);
what they burn is counted in CPU time, not wall time."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from tests.support.serve import cpu_by_role, cpu_seconds, group, role

BURN = 0.3  # CPU seconds the stand-in worker uses before it says so
READY_TIMEOUT_S = 60.0  # a bound on that wait, however loaded the machine
BURNER = (
    "import sys, time\n"
    f"while time.process_time() < {BURN}: pass\n"
    "print('burnt', flush=True)\n"
    "sys.stdin.read()\n"  # then wait, idle, until the test closes stdin or kills the group
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_groups_cpu_time_is_counted_per_role() -> None:
    # a group of one: bash execs Python under the title vLLM gives its workers, which burns
    # BURN s of CPU, says so and waits
    with subprocess.Popen(
        ["bash", "-c", 'exec -a VLLM::Worker_TP0 "$0" -c "$1"', sys.executable, BURNER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
        text=True,
    ) as leader:
        try:
            assert leader.stdout is not None
            ready, _, _ = select.select([leader.stdout], [], [], READY_TIMEOUT_S)
            assert ready, f"the stand-in worker did not burn {BURN} s of CPU in {READY_TIMEOUT_S} s"
            assert leader.stdout.readline() == "burnt\n"
            pgid = leader.pid
            assert group(pgid) == [leader.pid]  # ``exec``: the leader is the worker itself
            assert role(leader.pid, pgid) == "worker"
            used = cpu_by_role(pgid, pool=os.getpid())
            assert used["worker"] >= BURN - 0.02  # clock ticks round it
            assert used["engine"] == used["api"] == 0.0
            assert used["pool"] > 0  # this process, standing in for the pool, has used some
        finally:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(timeout=10)
    assert cpu_seconds(leader.pid) == 0.0  # reaped: gone from /proc
    assert cpu_by_role(leader.pid)["worker"] == 0.0


def test_a_group_leader_without_a_title_is_the_api_server() -> None:
    assert role(os.getpid(), os.getpid()) == "api"
    assert role(os.getpid(), os.getpid() + 1) == "other"
    assert role(0, 1) == "other"  # no such process
