"""``kvflow serve`` and ``kvflow pool stats|stop`` as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from kvflow.pool.launch import EXIT_RUNNING, is_serving, read_pid
from tests.pool.conftest import REPO, live_server_pids, wait_until

CAPACITY = 8 << 20


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvflow", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        raise AssertionError(f"{proc.args!r} ran past {timeout:g} s") from None
    return proc.returncode, out, err


def kvflow_cli(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    return finish(start(*args), timeout)


def test_serve_detach_stats_and_stop(sock_dir: str) -> None:
    path = f"{sock_dir}/pool.sock"
    try:
        code, out, err = kvflow_cli("serve", "--detach", "--socket", path, "--capacity", "8MiB")
        assert code == 0, err
        assert path in out
        assert is_serving(path)
        pid = read_pid(path)
        assert pid > 0 and live_server_pids(path) == [pid]

        # several commands at once against the running server
        stats = start("pool", "--socket", path, "stats")
        stats_json = start("pool", "--socket", path, "stats", "--json")
        again = start("serve", "--socket", path, "--capacity", "4MiB")  # foreground
        detach_again = start("serve", "--detach", "--socket", path, "--capacity", "4MiB")

        code, out, err = finish(stats)
        assert code == 0, err
        assert path in out and str(pid) in out
        capacity_line = next(line for line in out.splitlines() if "capacity" in line)
        assert f"{CAPACITY:,}" in capacity_line

        code, out, err = finish(stats_json)
        assert code == 0, err
        shown = json.loads(out)
        assert shown["capacity"] == CAPACITY
        assert shown["used"] == shown["objects"] == shown["pending_writes"] == 0
        assert shown["clients"] >= 1

        code, out, err = finish(again)
        assert code == EXIT_RUNNING == 3, (out, err)
        assert path in err

        code, out, err = finish(detach_again)
        assert code == 0, err
        assert path in out and str(pid) in out  # the running server, not a second one
        assert live_server_pids(path) == [pid]
        assert read_pid(path) == pid

        code, out, err = kvflow_cli("pool", "--socket", path, "stop")
        assert code == 0, err
        assert str(pid) in out
        assert not is_serving(path)
        # `stop` returns once the socket refuses connections; the files go just after
        wait_until(lambda: not os.path.exists(path), 5, "the socket to be removed")
        assert not os.path.exists(path + ".pid")
        wait_until(lambda: not live_server_pids(path), 10, "the server process to exit")

        # nothing serves now: both commands say so and fail
        stats = start("pool", "--socket", path, "stats", "--json")
        stop = start("pool", "--socket", path, "stop")
        code, out, err = finish(stats)
        assert code == 1 and out == "", (out, err)
        code, out, err = finish(stop)
        assert code == 1 and "no server" in err, (out, err)
    finally:
        for leftover in live_server_pids(path):
            os.kill(leftover, signal.SIGKILL)
