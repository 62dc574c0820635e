"""Starting a pool server in the background: ``kvflow serve --detach`` and client auto-start.

Many processes may race to start the server for one socket path; the server's lock file lets
exactly one win (the others exit with EXIT_RUNNING), and every starter then waits until the
socket accepts connections. Clients (``start_in_background``) also take turns, on the
``.start`` lock beside the socket, so a pool that went away under several clients costs one
server's start-up, not one per client, on a machine whose cores the model keeps busy. A
server found running is described (``running_pool``) and compared with what was asked
(``differences``), never passed off as one just started.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass

from kvflow.cpus import server_cpus
from kvflow.errors import PoolRunningError, StoreUnavailableError
from kvflow.pool import protocol as p
from kvflow.pool.client import PoolConnection
from kvflow.pool.config import PoolConfig
from kvflow.pool.paths import ensure_private_directory, sibling

__all__ = [
    "EXIT_RUNNING",
    "RunningPool",
    "differences",
    "is_serving",
    "running_pool",
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
    """The ``kvflow serve`` command line for ``config`` (this interpreter, this kvflow), with
    every setting of ``config``."""
    return [
        *(sys.executable, "-m", "kvflow", "serve", "--socket", config.socket),
        *("--capacity", str(config.size), "--lease-ttl", repr(float(config.lease_ttl_s))),
        *("--socket-mode", f"{config.socket_mode:04o}", "--max-clients", str(config.max_clients)),
        *("--idle-timeout", repr(float(config.idle_timeout_s))),
        *(arg for uid in config.allow_uids for arg in ("--allow-uid", str(uid))),
        *(
            ("--disk-dir", config.disk_dir, "--disk-capacity", str(int(config.disk_capacity)))
            if config.disk_dir
            else ()
        ),
        *("--disk-reads", config.disk_reads),
        *extra,
    ]


# OpenMP's thread placement. vLLM's CPU worker sets GOMP_CPU_AFFINITY to its compute cores and
# preloads libgomp, whose start-up pins the main thread of every process that inherits them: a
# pool server started from the worker would import on a compute core the model keeps busy (16
# s under a `vllm serve` load, against 0.3 s beside it).
_PLACEMENT = ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY")


def _server_env() -> dict[str, str]:
    """The environment a server starts with: this process's, less OpenMP's thread placement."""
    return {k: v for k, v in os.environ.items() if k not in _PLACEMENT}


def spawn_server(config: PoolConfig, *extra: str) -> subprocess.Popen[bytes]:
    """Start ``kvflow serve`` for ``config`` (and ``extra`` options) in a new session, logging
    beside the socket."""
    ensure_private_directory(os.path.dirname(config.socket))
    cmd = serve_command(config, *extra)
    fd = _open_log(config.socket)
    try:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            env=_server_env(),
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(fd)


def _open_log(path: str) -> int:
    """The log beside socket ``path`` (mode 0600), opened for appending."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    return os.open(sibling(path, ".log"), flags, 0o600)


def wait_until_serving(
    path: str, timeout_s: float, starter: subprocess.Popen[bytes] | int | None = None
) -> None:
    """Return once ``path`` accepts connections; StoreUnavailableError after ``timeout_s``, or
    as soon as ``starter`` (our child, or the pid of a server we started) has failed while
    nothing serves: exited, other than by losing the race (a child's exit 0 or EXIT_RUNNING)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while not is_serving(path):
        if _failed(starter) and not is_serving(path):
            log_path = sibling(path, ".log")
            raise StoreUnavailableError(
                f"the pool server for {path} exited before serving; see {log_path}: "
                f"{_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            raise StoreUnavailableError(f"no pool server on {path} after {timeout_s:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _failed(starter: subprocess.Popen[bytes] | int | None) -> bool:
    if isinstance(starter, int):
        return not alive(starter)
    return starter is not None and starter.poll() not in (None, 0, EXIT_RUNNING)


def start_detached(config: PoolConfig, timeout_s: float, *extra: str) -> int:
    """Start a server (``extra``: more ``kvflow serve`` options, such as ``--metrics-port``) in
    the background and return its pid once it serves. PoolRunningError
    if another server serves the path (found there, or it won the race to start);
    StoreUnavailableError if ours failed to start or did not serve within ``timeout_s``."""
    if is_serving(config.socket):
        raise PoolRunningError(config.socket)
    proc = spawn_server(config, *extra)
    wait_until_serving(config.socket, timeout_s, proc)
    deadline = time.monotonic() + timeout_s
    while read_pid(config.socket) != proc.pid:  # ours, or another server that won the race?
        code = proc.poll()
        if code == EXIT_RUNNING:
            raise PoolRunningError(config.socket)
        if code is not None or time.monotonic() > deadline:
            raise StoreUnavailableError(
                f"the pool server for {config.socket} failed to start (exit {code}); "
                f"see {sibling(config.socket, '.log')}"
            )
        time.sleep(0.01)
    return proc.pid


@dataclass(frozen=True)
class RunningPool:
    """What a running server says about itself (``running_pool``)."""

    socket: str
    pid: int  # 0 if no pid file says
    capacity: int
    lease_ttl_s: float
    max_clients: int
    idle_timeout_s: float
    socket_mode: int
    disk_capacity: int = 0  # 0: no disk tier

    def describe(self) -> str:
        disk = f", disk tier {_size(self.disk_capacity)}" if self.disk_capacity else ""
        return (
            f"pid {self.pid or '?'}, capacity {_size(self.capacity)}, lease TTL "
            f"{self.lease_ttl_s:g} s, max {self.max_clients} clients, idle timeout "
            f"{self.idle_timeout_s:g} s, socket mode {self.socket_mode:04o}{disk}"
        )


def running_pool(path: str, timeout_s: float = 5.0) -> RunningPool:
    """Ask the server on ``path`` for its settings (StoreUnavailableError if none answers)."""
    conn = PoolConnection(path, timeout_s)
    try:
        code, body = conn.request(p.Op.STATS)
        hello = conn.hello
    finally:
        conn.goodbye()
        conn.unmap()
    if code != p.Code.OK:
        raise StoreUnavailableError(f"the pool server on {path} replied {code.name} to STATS")
    stats = p.parse_stats(body)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as exc:
        raise StoreUnavailableError(f"the pool server's socket {path}: {exc}") from exc
    return RunningPool(
        socket=path,
        pid=read_pid(path),
        capacity=hello.capacity,
        lease_ttl_s=hello.lease_ttl_ms / 1000,
        max_clients=stats.get("max_clients", 0),
        idle_timeout_s=stats.get("idle_timeout_ms", 0) / 1000,
        socket_mode=mode,
        disk_capacity=stats.get("disk_capacity", 0),
    )


def differences(config: PoolConfig, running: RunningPool, asked: Collection[str]) -> list[str]:
    """How ``running`` differs from ``config`` in the settings named in ``asked`` (PoolConfig
    field names); one phrase each, e.g. ``"capacity 4.0 MiB asked, 8.0 MiB running"``.
    ``allow_uids`` is not compared: a server does not say whom it allows."""
    ms = _milliseconds
    settings = (  # field, its name, (asked, running) as compared, shown
        ("capacity", "capacity", config.size, running.capacity, _size),
        ("lease_ttl_s", "lease TTL", ms(config.lease_ttl_s), ms(running.lease_ttl_s), _seconds),
        ("max_clients", "max clients", config.max_clients, running.max_clients, str),
        ("idle_timeout_s", "idle timeout", ms(config.idle_timeout_s), ms(running.idle_timeout_s),
         _seconds),
        ("socket_mode", "socket mode", config.socket_mode, running.socket_mode, "{:04o}".format),
        ("disk_capacity", "disk capacity", int(config.disk_capacity), running.disk_capacity,
         _size),
    )  # fmt: skip
    return [
        f"{name} {show(want)} asked, {show(have)} running"
        for field, name, want, have, show in settings
        if field in asked and want != have
    ]


def start_in_background(config: PoolConfig, timeout_s: float) -> None:
    """From a client: start a server and return once one serves ``config.socket`` (ours, or
    one another process started); StoreUnavailableError if none does within ``timeout_s``.

    One client at a time starts one (the ``.start`` lock beside the socket): the others wait
    for it to serve, and take over if it fails. The server is not this process's child (it is
    started through ``sh``, which exits at once), so it outlives this process, and this
    process neither reaps it nor stops it with its own process group. It runs on
    ``server_cpus()``, not on the calling thread's CPUs (a compute core, in vLLM's worker)."""
    ensure_private_directory(os.path.dirname(config.socket))
    deadline = time.monotonic() + timeout_s
    fd = os.open(sibling(config.socket, ".start"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        delay = 0.005
        while not is_serving(config.socket):
            if _try_lock(fd):
                try:
                    if not is_serving(config.socket):
                        _start_and_wait(config, deadline)
                    return
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() > deadline:  # another client is starting one: wait for it
                raise StoreUnavailableError(
                    f"no pool server on {config.socket} after {timeout_s:g} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _start_and_wait(config: PoolConfig, deadline: float) -> None:
    """Start a detached server; return once one serves. A server that exits first (another
    took the socket's lock, or it failed) is fine if another serves by then."""
    cpus = server_cpus()
    cmd = serve_command(config, *(("--cpus", ",".join(map(str, cpus))) if cpus else ()))
    log = _open_log(config.socket)  # the shell's stderr; the server's stdout and stderr
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", '"$@" >&2 </dev/null & echo $!', "kvflow-start", *cmd],
            stdout=subprocess.PIPE,
            stderr=log,
            env=_server_env(),
            timeout=max(deadline - time.monotonic(), 1.0),
            start_new_session=True,
            check=True,
        )
        pid = int(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        reason = f"could not start a pool server on {config.socket}: {exc}"
        raise StoreUnavailableError(reason) from exc
    finally:
        os.close(log)
    if cpus:  # its interpreter starts up on them too, not on the caller's CPUs
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)
    wait_until_serving(config.socket, max(deadline - time.monotonic(), 0.0), pid)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs. A zombie does not: it has exited, and whoever
    inherited it (init, for a detached server) may reap it only a second or more later."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_pid(path: str) -> int:
    with contextlib.suppress(OSError, ValueError), open(sibling(path, ".pid")) as f:
        return int(f.read().strip())
    return 0


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def _milliseconds(seconds: float) -> int:
    return round(seconds * 1000)  # what the server reports: whole milliseconds


def _seconds(ms: int) -> str:
    return f"{ms / 1000:g} s"


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return "(no log)"
