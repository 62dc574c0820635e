"""Child processes the tests start and always stop: ``kvflow serve`` (``ServeProcess``) and
worker modules (``Worker``, ``spawn_workers``), logging to files whose tails failures show;
and what ``/proc`` says of the pool servers and their threads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvflow.pool.launch import is_serving
from tests.support.waits import wait_until

__all__ = [
    "REPO",
    "ServeProcess",
    "Worker",
    "Workers",
    "live_server_pids",
    "spawn_workers",
    "thread_affinities",
]

REPO = Path(__file__).resolve().parents[2]


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def _end(proc: subprocess.Popen[bytes], term_timeout: float = 60.0) -> None:
    """Stop a child we started: SIGTERM, then SIGKILL once it had ``term_timeout`` s to exit
    (far above a clean exit on a loaded machine: a test may check what the exit leaves);
    always reaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(term_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)


class ServeProcess:
    """``python -m kvflow serve`` on ``socket_path`` as a child process, logging to a file."""

    def __init__(self, socket_path: str, capacity: int | str, *extra: str) -> None:
        self.socket_path = socket_path
        self.log_path = os.path.join(os.path.dirname(socket_path), "serve.out")
        cmd = [sys.executable, "-m", "kvflow", "serve", "--socket", socket_path]
        cmd += ["--capacity", str(capacity), *extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_serving(self, timeout: float = 60.0) -> ServeProcess:
        wait_until(
            lambda: is_serving(self.socket_path) or self.proc.poll() is not None,
            timeout,
            f"kvflow serve on {self.socket_path}",
        )
        if self.proc.poll() is not None:
            raise AssertionError(
                f"kvflow serve exited with {self.proc.returncode}: {_tail(self.log_path)}"
            )
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as in a crash."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)

    def stop(self) -> None:
        _end(self.proc)

    def log(self) -> str:
        return _tail(self.log_path)


class Worker:
    """``python -m MODULE NAME ARGS`` (``tests.support.pool_workers`` unless told) as a child
    process. It reports through files in ``directory``: ``<tag>.ready`` when it has reached its
    waiting point (if any), and ``<tag>.json`` with its result when it finishes."""

    def __init__(
        self,
        directory: str,
        tag: str,
        name: str,
        /,
        module: str = "tests.support.pool_workers",
        **args: Any,
    ) -> None:
        self.tag = tag
        self.ready_path = os.path.join(directory, f"{tag}.ready")
        self.result_path = os.path.join(directory, f"{tag}.json")
        self.log_path = os.path.join(directory, f"{tag}.out")
        args = {**args, "ready": self.ready_path, "result": self.result_path}
        cmd = [sys.executable, "-m", module, name, json.dumps(args)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        wait_until(
            lambda: os.path.exists(self.ready_path) or self.proc.poll() is not None,
            timeout,
            f"worker {self.tag} to get ready",
        )
        if not os.path.exists(self.ready_path):
            raise AssertionError(f"worker {self.tag} exited early: {self.output()}")
        with open(self.ready_path) as f:
            ready: dict[str, Any] = json.load(f)
        return ready

    def result(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
            raise AssertionError(
                f"worker {self.tag} ran past {timeout:g} s: {self.output()}"
            ) from None
        if code != 0 or not os.path.exists(self.result_path):
            raise AssertionError(f"worker {self.tag} exited with {code}: {self.output()}")
        with open(self.result_path) as f:
            result: dict[str, Any] = json.load(f)
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)

    def output(self) -> str:
        return _tail(self.log_path)


@contextlib.contextmanager
def spawn_workers(
    directory: str, module: str = "tests.support.pool_workers"
) -> Iterator[Callable[..., Worker]]:
    """``start(tag, name, **args)`` runs a ``module`` worker reporting into ``directory``;
    every worker started is killed when the block ends."""
    started: list[Worker] = []

    def start(tag: str, name: str, /, **args: Any) -> Worker:
        worker = Worker(directory, tag, name, module=module, **args)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.stop()


def live_server_pids(socket_path: str) -> list[int]:
    """Pids of live (not zombie) ``kvflow serve`` processes for ``socket_path``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state in (b"Z", b"X") or b"serve" not in argv:
            continue
        if os.fsencode(socket_path) in argv:
            pids.append(int(entry))
    return pids


def thread_affinities(pid: int) -> list[frozenset[int]]:
    """The CPU affinity of each live thread of process ``pid`` (a connection's thread may end
    between listing and asking: it is left out)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            out.append(frozenset(os.sched_getaffinity(int(tid))))
    return out


Workers = Callable[..., Worker]  # ``start(tag, name, **args)`` as ``spawn_workers`` yields it


def stop_servers(socket_path: str) -> None:
    """SIGTERM every live ``kvflow serve`` of ``socket_path`` (auto-started ones: no handle
    here) and wait until none is left."""
    from tests.support.waits import wait_until

    for pid in live_server_pids(socket_path):
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not live_server_pids(socket_path), 60, "the pool server to exit")
