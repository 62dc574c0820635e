"""``kvflow serve`` and ``kvflow pool stats|stop`` as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvflow
from kvflow.abc import WriteSession
from kvflow.cli import main
from kvflow.pool.launch import EXIT_RUNNING, alive, is_serving, read_pid
from tests.support.processes import REPO, ServeProcess, live_server_pids, thread_affinities
from tests.support.waits import wait_until

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
        proc.communicate(timeout=60)
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
        stats_json = start("pool", "stats", "--json", "--socket", path)  # either place
        again = start("serve", "--socket", path, "--capacity", "4MiB")  # foreground
        detach_other = start("serve", "--detach", "--socket", path, "--capacity", "4MiB")
        detach_same = start("serve", "--detach", "--socket", path, "--capacity", "8MiB")

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

        # --detach does not pass the running server off as one it started: it says which
        # server runs, and succeeds only if that one has the settings asked for
        code, out, err = finish(detach_other)
        assert code == EXIT_RUNNING, (out, err)
        assert "already runs" in err and path in err and f"pid {pid}" in err
        assert "capacity 4.0 MiB (4,194,304 bytes) asked, 8.0 MiB (8,388,608 bytes) running" in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        code, out, err = finish(detach_same)
        assert code == 0, err
        assert "already running" in out and f"pid {pid}" in out and "nothing started" in out
        assert live_server_pids(path) == [pid]
        assert read_pid(path) == pid

        code, out, err = kvflow_cli("pool", "stop", "--socket", path)
        assert code == 0, err
        assert f"stopped the pool on {path} (pid {pid})" in out
        assert not is_serving(path)
        # `stop` returns once the socket refuses connections; the files go just after
        wait_until(lambda: not os.path.exists(path), 60, "the socket to be removed")
        assert not os.path.exists(path + ".pid")
        wait_until(lambda: not live_server_pids(path), 60, "the server process to exit")

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


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detach"])
def test_serve_beyond_the_machine_refuses_at_once(sock_dir: str, detach: bool) -> None:
    path = f"{sock_dir}/pool/pool.sock"
    code, out, err = kvflow_cli(
        "serve", "--socket", path, "--capacity", "1TB", *(["--detach"] if detach else [])
    )
    assert code == 1, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "1,000,000,000,000 bytes" in err  # what was asked
    assert "MemAvailable in /proc/meminfo" in err  # what there is
    assert "use a smaller --capacity" in err  # what to do
    assert not os.path.exists(os.path.dirname(path))  # no socket, lock, pid or log file
    assert not live_server_pids(path)


def test_detach_keeps_every_setting_and_compares_those_given(sock_dir: str) -> None:
    path = f"{sock_dir}/pool.sock"
    # a limit the three serve commands below cannot reach at once (each probes, then asks)
    settings = ("--socket-mode", "0640", "--max-clients", "17", "--idle-timeout", "7")
    try:
        code, out, err = kvflow_cli(
            "serve", "--detach", "--socket", path, "--capacity", "4MiB", *settings
        )
        assert code == 0, err
        pid = read_pid(path)
        assert f"pid {pid}" in out
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
        code, out, err = kvflow_cli("pool", "--socket", path, "stats", "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert (shown["max_clients"], shown["idle_timeout_ms"]) == (17, 7000)

        same = start("serve", "--detach", "--socket", path, "--capacity", "4MiB", *settings)
        nothing_given = start("serve", "--detach", "--socket", path)
        other = start("serve", "--detach", "--socket", path, "--idle-timeout", "8")
        for proc in (same, nothing_given):
            code, out, err = finish(proc)
            assert code == 0 and "already running" in out and f"pid {pid}" in out, (out, err)
        code, out, err = finish(other)
        assert code == EXIT_RUNNING, (out, err)
        assert "idle timeout 8 s asked, 7 s running" in err and f"pid {pid}" in err
        assert live_server_pids(path) == [pid]
    finally:
        kvflow_cli("pool", "--socket", path, "stop")
        for leftover in live_server_pids(path):
            os.kill(leftover, signal.SIGKILL)


def test_the_connection_limit_tells_the_refused_client(
    sock_dir: str, serve: Callable[..., ServeProcess]
) -> None:
    """A client holding a session fills a pool limited to one connection: another is told so,
    in one line. Once the first has ended its session and stayed idle for the timeout, clients
    get in again, the refusal and the idle close are counted, and the first client's next call
    works (it reconnects)."""
    path = f"{sock_dir}/pool.sock"
    serve(path, "4MiB", "--max-clients", "1", "--idle-timeout", "1")
    store = kvflow.SharedStore(socket=path, timeout_s=60)

    def open_write() -> WriteSession | None:
        try:
            return store.open_write(["k"], 8192)
        except kvflow.StoreUnavailableError:  # the readiness probe's connection is still counted
            return None

    try:
        # not idle while this is open
        writing = wait_until(open_write, 60, "the one connection to be free", interval=0.2)
        code, out, err = kvflow_cli("pool", "--socket", path, "stats")
        assert code == 1 and out == "", (out, err)
        assert len(err.strip().splitlines()) == 1, err
        assert "refused the connection" in err and "limit of 1 connections" in err
        assert "--max-clients" in err and "reset by peer" not in err
        store.finish_write(writing, np.zeros(1, dtype=bool))

        def stats() -> dict[str, int] | None:
            code, out, _ = kvflow_cli("pool", "--socket", path, "stats", "--json")
            return json.loads(out) if code == 0 else None

        shown = wait_until(stats, 60, "room on the pool again", interval=0.2)
        assert shown["refused_limit"] >= 1 and shown["idle_closed"] >= 1
        assert store.lookup(["k"]).tolist() == [False]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--socket-mode", "9"], "argument --socket-mode: expected permission bits"),
        (["serve", "--socket-mode", "0o1777"], "argument --socket-mode: expected permission"),
        (["serve", "--capacity", "8XB"], "argument --capacity: expected a size such as 8GiB"),
        (["serve", "--idle-timeout", "0"], "argument --idle-timeout: expected a number of"),
        (["serve", "--lease-ttl", "inf"], "argument --lease-ttl: expected a number of"),
        (["serve", "--max-clients", "many"], "argument --max-clients: expected an integer >= 1"),
        (["serve", "--allow-uid", "-1"], "argument --allow-uid: expected a user id"),
        (["pool", "stop", "--timeout", "x"], "argument --timeout: expected a number of seconds"),
    ],
)
def test_bad_option_values_name_the_option(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "<lambda>" not in err, err


def test_serve_pins_its_threads_to_the_cpus_given(sock_dir: str) -> None:
    path = f"{sock_dir}/pool.sock"
    cpu = max(os.sched_getaffinity(0))
    try:
        code, _, err = kvflow_cli(
            "serve", "--detach", "--socket", path, "--capacity", "8MiB", "--cpus", str(cpu)
        )
        assert code == 0, err
        pid = read_pid(path)
        affinities = thread_affinities(pid)
        assert len(affinities) > 1  # the accept and lease threads too
        assert set(affinities) == {frozenset({cpu})}
    finally:
        for pid in live_server_pids(path):
            os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not live_server_pids(path), 60, "the server to exit")

    code, _, err = kvflow_cli("serve", "--socket", path, "--capacity", "8MiB", "--cpus", "99999")
    assert code == 2
    assert "--cpus (99999,)" in err and not os.path.exists(path)


def test_the_pool_server_imports_no_torch() -> None:
    """A client that finds the pool gone starts ``kvflow serve``: its imports are what the
    clients wait for, so the server's modules leave the engine (and torch) unimported, while
    ``kvflow.TransferEngine`` and the rest still resolve on first use."""
    script = (
        "import sys\n"
        "import kvflow.pool.cli, kvflow.cli\n"
        "print('torch' in sys.modules)\n"
        "import kvflow\n"
        "print(kvflow.TransferEngine.__module__, kvflow.SharedStore.__module__)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == [
        "False",
        "kvflow.pipeline.engine kvflow.pool.store",
        "True",
    ]
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        kvflow.Nope  # noqa: B018


def test_a_zombie_is_not_a_running_server() -> None:
    """A detached server that exited stays a zombie until init reaps it, which may take a
    second: ``pool stop`` must not wait for that (``alive``)."""
    child = subprocess.Popen(["true"])
    try:
        wait_until(
            lambda: (
                Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
            ),
            timeout=60.0,
            what="the child to exit",
        )
        assert not alive(child.pid)
        assert alive(os.getpid())
    finally:
        child.wait()
    assert not alive(child.pid)


def test_a_sigterm_the_moment_the_pool_serves_stops_it_cleanly(sock_dir: str) -> None:
    """The signal handlers are in place before the socket serves: a client that stops a server
    the moment it answers (a restart) gets a clean exit, status 0 and the socket removed, never
    a process killed with its files left behind."""
    path = f"{sock_dir}/pool.sock"
    for _ in range(3):
        server = ServeProcess(path, "8MiB")
        try:
            deadline = time.monotonic() + 60
            while not is_serving(path):  # no sleep: signal it as soon as it serves
                assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            os.kill(server.pid, signal.SIGTERM)
            assert server.proc.wait(60) == 0, server.log()
            assert not os.path.exists(path)
        finally:
            server.stop()
