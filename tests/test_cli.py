"""The ``kvflow`` command as a user runs it: a reader that goes away ends any command quietly,
and ``kvflow bench`` refuses an output path it could not write before it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.bench.args import check_output_path
from kvflow.cli import EXIT_BROKEN_PIPE
from kvflow.errors import ConfigError
from kvflow.pool import PoolConfig, PoolServer

REPO = Path(__file__).resolve().parents[1]


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvflow ARGS`` with its stdout a pipe nobody reads any more (as ``| head -1`` after
    its first line): every write to it fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvflow", *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.fixture
def pool_socket(tmp_path: Path) -> Iterator[str]:
    with PoolServer(PoolConfig(socket=str(tmp_path / "pool.sock"), capacity="1MiB")) as server:
        yield server.socket_path


@pytest.mark.parametrize("json_output", [False, True], ids=["table", "json"])
def test_pool_stats_into_a_closed_pipe(pool_socket: str, json_output: bool) -> None:
    done = run_into_closed_pipe("pool", "--socket", pool_socket, "stats", *["--json"] * json_output)
    assert done.stderr == ""  # no BrokenPipeError, no traceback, no "Exception ignored"
    assert done.returncode == EXIT_BROKEN_PIPE


def test_bench_refuses_a_json_path_it_could_not_write_before_running(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the JSON's folder should be\n")
    target = blocker / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvflow", "bench", "addrgen", "--quick", "--json", str(target)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 1, done
    assert done.stdout == ""  # nothing was measured
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("kvflow bench addrgen: --json=")
    assert lines[0].endswith(f"cannot create its folder {blocker}: a file is in the way")


def test_output_paths(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b" / "out.json"
    check_output_path(str(nested), "--json")
    assert nested.parent.is_dir() and not nested.exists()  # the folder, as writing would
    with pytest.raises(ConfigError, match=r"--plot=.*is a folder"):
        check_output_path(str(tmp_path), "--plot")
    with pytest.raises(ConfigError, match="cannot create its folder"):
        check_output_path("/proc/self/no/such/out.json", "--json")
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    try:
        if os.access(tmp_path / "ro", os.W_OK):
            return  # root writes anywhere: nothing more to check
        with pytest.raises(ConfigError, match="cannot be written"):
            check_output_path(str(tmp_path / "ro" / "out.json"), "--json")
    finally:
        os.chmod(tmp_path / "ro", 0o700)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ttft", "--hit-rate", "2"], "argument --hit-rate: expected a number between 0 and 1"),
        (["ttft", "--layers", "0"], "argument --layers: expected an integer >= 1, got '0'"),
        (["copy", "--repeats", "-2"], "argument --repeats: expected an integer >= 1"),
        (["copy", "--threads", "1,x"], "argument --threads: expected comma-separated integers"),
        (["copy", "--blocks", "4x"], "argument --blocks: expected comma-separated sizes"),
        (["copy", "--cpus", "a"], "argument --cpus: expected CPU numbers such as 0,1"),
        (["metadata", "--layers", "8,0"], "argument --layers: expected comma-separated integers"),
    ],
)
def test_bench_option_values_are_refused_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any run: a value the scenario cannot use says which option and what it takes."""
    from kvflow.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "<lambda>" not in err and "invalid" not in err, err
