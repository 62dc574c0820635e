"""Starting a pool server in the background: ``kvflow serve --detach`` and client auto-start.

Many processes may race to start the server for one socket path; the server's lock file lets
exactly one win (the others exit with EXIT_RUNNING), and every starter then waits until the
socket accepts connections.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

from kvflow.errors import StoreUnavailableError
from kvflow.pool.paths import ensure_private_directory, sibling
from kvflow.pool.server import PoolConfig

__all__ = [
    "EXIT_RUNNING",
    "is_serving",
    "serve_command",
    "spawn_server",
    "start_detached",
    "start_in_background",
    "wait_until_serving",
]

EXIT_RUNNING = 3  # `kvflow serve` found another server on its socket path


def is_serving(path: str) -> bool:
    """True if a server accepts connections on ``path`` now."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        sock.connect(path)
    except OSError:
        return False
    finally:
        sock.close()
    return True


def serve_command(config: PoolConfig, *extra: str) -> list[str]:
    """The ``kvflow serve`` command line for ``config`` (this interpreter, this kvflow)."""
    return [
        *(sys.executable, "-m", "kvflow", "serve", "--socket", config.socket),
        *("--capacity", str(config.size), "--lease-ttl", repr(float(config.lease_ttl_s))),
        *extra,
    ]


def spawn_server(config: PoolConfig) -> subprocess.Popen[bytes]:
    """Start ``kvflow serve`` for ``config`` in a new session, logging beside the socket."""
    ensure_private_directory(os.path.dirname(config.socket))
    cmd = serve_command(config)
    log_path = sibling(config.socket, ".log")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(fd)


def wait_until_serving(
    path: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Return once ``path`` accepts connections; StoreUnavailableError after ``timeout_s`` or if
    ``proc`` (our starter) failed for a reason other than losing the race."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        if is_serving(path):
            return
        code = proc.poll() if proc is not None else None
        if code not in (None, 0, EXIT_RUNNING):
            raise StoreUnavailableError(
                f"the pool server for {path} failed to start (exit {code}); "
                f"see {sibling(path, '.log')}: {_tail(sibling(path, '.log'))}"
            )
        if time.monotonic() > deadline:
            raise StoreUnavailableError(f"no pool server on {path} after {timeout_s:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def start_detached(config: PoolConfig, timeout_s: float) -> int:
    """Start a server in the background unless one serves already; returns its pid (0 if it
    was already running and no pid file says which)."""
    if not is_serving(config.socket):
        proc = spawn_server(config)
        wait_until_serving(config.socket, timeout_s, proc)
    return read_pid(config.socket)


def start_in_background(config: PoolConfig, timeout_s: float) -> None:
    """From a client: run ``kvflow serve --detach`` and wait for it. The server is its child,
    not ours, so this process holds no handle on it and it outlives us."""
    cmd = serve_command(config, "--detach", "--start-timeout", repr(float(timeout_s)))
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s + 10, check=False)
    except subprocess.TimeoutExpired as exc:
        raise StoreUnavailableError(
            f"no pool server on {config.socket} after {timeout_s:g} s"
        ) from exc
    if done.returncode != 0:
        reason = done.stderr.decode("utf-8", "replace").strip()[-400:]
        raise StoreUnavailableError(f"could not start a pool server on {config.socket}: {reason}")


def read_pid(path: str) -> int:
    with contextlib.suppress(OSError, ValueError), open(sibling(path, ".pid")) as f:
        return int(f.read().strip())
    return 0


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return "(no log)"
