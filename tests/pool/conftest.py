"""Helpers for the pool tests: short private socket directories, bounded polls, raw protocol
sockets, and ``kvflow serve`` / worker subprocesses that are always cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvflow.pool import protocol as p
from kvflow.pool.launch import is_serving

__all__ = [
    "REPO",
    "Greeted",
    "ServeProcess",
    "Worker",
    "greet",
    "live_server_pids",
    "spawn_workers",
    "read_to_eof",
    "recv_exact",
    "wait_for_stats",
    "wait_until",
]

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def wait_for_stats(
    read: Callable[[], dict[str, int]],
    done: Callable[[dict[str, int]], bool],
    timeout: float,
    what: str,
) -> dict[str, int]:
    """Poll a server's counters (``read()``) until ``done(stats)``; returns those stats."""
    seen: list[dict[str, int]] = []

    def check() -> bool:
        seen[:] = [read()]
        return done(seen[0])

    wait_until(check, timeout, what)
    return seen[0]


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A fresh private (0700) directory with a short path, for a socket and its siblings."""
    directory = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- raw protocol sockets ---------------------------------------------------------------------


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; EOFError if the peer closes first (the socket's timeout applies)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_to_eof(sock: socket.socket, limit: int = 1 << 27) -> bytes:
    """Everything the peer sends until it closes (a reset counts as a close). The socket's
    timeout bounds every wait: a peer that neither answers nor closes raises TimeoutError."""
    out = bytearray()
    while len(out) < limit:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


class Greeted:
    """A raw connection that has said HELLO: the reply (its header's ``flags`` too), and the
    file descriptors that came with it (closed by ``close()``)."""

    def __init__(
        self, sock: socket.socket, code: int, body: bytes, fds: list[int], flags: int = 0
    ) -> None:
        self.sock = sock
        self.code = code
        self.body = body
        self.fds = fds
        self.flags = flags

    @property
    def hello(self) -> p.Hello:
        return p.parse_hello(self.body)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.sock.close()


@contextlib.contextmanager
def greet(path: str, timeout: float = 5.0) -> Iterator[Greeted]:
    """Connect to ``path`` and say HELLO by hand (receiving the arena fd with SCM_RIGHTS)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(p.frame(p.Op.HELLO, 1, p.hello_body(os.getpid())))
        header, fds, _, _ = socket.recv_fds(sock, p.HEADER.size, 4)
        if not header:
            raise EOFError("the server closed the connection instead of answering HELLO")
        header += recv_exact(sock, p.HEADER.size - len(header))
        length, version, code, flags, rid = p.HEADER.unpack(header)
        assert (version, rid) == (p.VERSION, 1)
        body = recv_exact(sock, length)
    except BaseException:
        Greeted(sock, -1, b"", list(fds)).close()
        raise
    greeted = Greeted(sock, code, body, list(fds), flags)
    try:
        yield greeted
    finally:
        greeted.close()


# -- subprocesses -----------------------------------------------------------------------------


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def _end(proc: subprocess.Popen[bytes], term_timeout: float = 10.0) -> None:
    """Stop a child we started: SIGTERM, then SIGKILL; always reaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(term_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


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
        self.proc.wait(10)

    def stop(self) -> None:
        _end(self.proc)

    def log(self) -> str:
        return _tail(self.log_path)


@pytest.fixture
def serve() -> Iterator[Callable[..., ServeProcess]]:
    """Start ``kvflow serve`` processes (``serve(path, capacity, *args)``, already serving);
    every one is stopped when the test ends."""
    started: list[ServeProcess] = []

    def start(socket_path: str, capacity: int | str = "16MiB", *extra: str) -> ServeProcess:
        server = ServeProcess(socket_path, capacity, *extra)
        started.append(server)
        return server.wait_serving()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


class Worker:
    """``python -m MODULE NAME ARGS`` (``tests.pool.workers`` unless told) as a child process.
    It reports through files in ``directory``: ``<tag>.ready`` when it has reached its waiting
    point (if any), and ``<tag>.json`` with its result when it finishes."""

    def __init__(
        self,
        directory: str,
        tag: str,
        name: str,
        /,
        module: str = "tests.pool.workers",
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
            self.proc.wait(10)
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
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def output(self) -> str:
        return _tail(self.log_path)


@pytest.fixture
def workers(sock_dir: str) -> Iterator[Callable[..., Worker]]:
    """Start worker processes (``workers(tag, name, **args)``); all are killed at the end."""
    with spawn_workers(sock_dir) as start:
        yield start


@contextlib.contextmanager
def spawn_workers(
    directory: str, module: str = "tests.pool.workers"
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
