"""``kvflow serve`` and ``kvflow pool stats|stop``: run and inspect the node-local pool."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from kvflow import trace
from kvflow.config import parse_size
from kvflow.cpus import cpu_list, pin_all_threads
from kvflow.errors import ConfigError, KVFlowError, PoolRunningError, StoreError
from kvflow.pool.client import query_stats
from kvflow.pool.config import (
    DEFAULT_CAPACITY,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_CLIENTS,
    DISK_READS,
    PoolConfig,
)
from kvflow.pool.launch import (
    EXIT_RUNNING,
    alive,
    differences,
    is_serving,
    read_pid,
    running_pool,
    start_detached,
)
from kvflow.pool.metrics import DEFAULT_METRICS_HOST, MetricsEndpoint, require_client
from kvflow.pool.paths import check_socket_path, default_socket
from kvflow.pool.server import PoolServer
from kvflow.stores.hostmem import check_capacity

__all__ = ["add_commands"]

# `kvflow serve` options and the PoolConfig field each sets; None as the default tells an
# option given from one left out (a pool found running is compared on those given)
_SETTINGS = {
    "capacity": "capacity",
    "lease_ttl": "lease_ttl_s",
    "allow_uid": "allow_uids",
    "socket_mode": "socket_mode",
    "max_clients": "max_clients",
    "idle_timeout": "idle_timeout_s",
    "disk_dir": "disk_dir",
    "disk_capacity": "disk_capacity",
    "disk_reads": "disk_reads",
}


def _capacity(text: str) -> str:
    """The size as given (messages show it so), once it parses."""
    try:
        parse_size(text.strip(), argument="--capacity")
    except KVFlowError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 8GiB or 512MiB, got {text!r}"
        ) from None
    return text.strip()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0-65535 (0: any free), got {text!r}")
    return value


def _uid(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a user id (an integer >= 0), got {text!r}")
    return int(text)


def _octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 < mode <= 0o777:
        raise argparse.ArgumentTypeError(
            f"expected permission bits in octal such as 0600 or 0666, got {text!r}"
        )
    return mode


def add_commands(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the node-local shared pool server",
        description="Run a pool server: a shared-memory arena that every kvflow process on this "
        "machine reaches through SharedStore.",
    )
    serve.add_argument("--socket", default="", help=f"socket path (default {default_socket()})")
    serve.add_argument(
        "--capacity", type=_capacity, help=f"arena size, e.g. 8GiB (default {DEFAULT_CAPACITY})"
    )
    serve.add_argument(
        "--lease-ttl",
        type=_seconds,
        metavar="SECONDS",
        help=f"read lease limit (default {DEFAULT_LEASE_TTL_S:g})",
    )
    serve.add_argument(
        "--allow-uid", type=_uid, action="append", metavar="UID", help="also accept this uid"
    )
    serve.add_argument(
        "--socket-mode",
        type=_octal_mode,
        metavar="MODE",
        help="socket permission bits, octal (0600; other uids need e.g. 0666 and a directory "
        "they may traverse)",
    )
    serve.add_argument(
        "--max-clients",
        type=_count,
        metavar="N",
        help=f"connections served at once; more are refused (default {DEFAULT_MAX_CLIENTS})",
    )
    serve.add_argument(
        "--idle-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="close a connection that holds no session and sends nothing for this long; "
        f"clients reconnect on their next call (default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    serve.add_argument(
        "--disk-dir",
        metavar="DIR",
        help="a disk tier in this folder: what DRAM evicts is still served from disk, and "
        "what it holds is served again after a restart (needs --disk-capacity)",
    )
    serve.add_argument(
        "--disk-capacity", type=_capacity, metavar="SIZE", help="the disk tier's size, e.g. 100GiB"
    )
    serve.add_argument(
        "--disk-reads",
        choices=DISK_READS,
        help="a chunk on disk only is read layer by layer from its file by the client "
        "(layerwise, the default) or copied into DRAM first (promote)",
    )
    serve.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve the pool's counters for Prometheus on http://HOST:PORT/metrics "
        "(needs kvflow[metrics])",
    )
    serve.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        metavar="HOST",
        help=f"the address --metrics-port binds (default {DEFAULT_METRICS_HOST})",
    )
    serve.add_argument(
        "--cpus",
        type=cpu_list,
        metavar="LIST",
        help="pin the server's threads to these CPUs, e.g. 2,3 (default: as started)",
    )
    serve.add_argument(
        "--detach",
        action="store_true",
        help="run in the background; if a pool already runs on the socket, succeed only if it "
        "has the settings given",
    )
    serve.add_argument(
        "--start-timeout", type=_seconds, default=120.0, metavar="SECONDS", help="with --detach"
    )
    serve.set_defaults(handler=_serve)

    pool = commands.add_parser("pool", help="inspect or stop a running pool server")
    pool.add_argument("--socket", default="", help=f"socket path (default {default_socket()})")
    actions = pool.add_subparsers(dest="action", required=True)
    stats = actions.add_parser("stats", help="capacity, use, objects, leases and counters")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(handler=_stats)
    stop = actions.add_parser("stop", help="stop the server (SIGTERM) and wait for it")
    stop.add_argument("--timeout", type=_seconds, default=10.0, metavar="SECONDS")
    stop.set_defaults(handler=_stop)
    for action in (stats, stop):  # `pool stats --socket S` as well as `pool --socket S stats`
        action.add_argument("--socket", default=argparse.SUPPRESS, help="socket path")


def _serve(args: argparse.Namespace) -> int:
    given = {
        field: getattr(args, option)
        for option, field in _SETTINGS.items()
        if getattr(args, option) is not None
    }
    if "allow_uids" in given:
        given["allow_uids"] = tuple(given["allow_uids"])
    config = PoolConfig(socket=args.socket, **given)
    passed: tuple[str, ...] = ()
    if args.metrics_port is not None:
        require_client()  # before anything starts
        passed = ("--metrics-port", str(args.metrics_port))
        passed += ("--metrics-host", args.metrics_host)
    if is_serving(config.socket):
        return _already_running(config, set(given), args.detach)
    hint = "use a smaller --capacity or free memory"
    check_capacity(config.size, args.capacity or DEFAULT_CAPACITY, hint=hint)
    if args.cpus:
        passed += ("--cpus", ",".join(map(str, args.cpus)))
    if args.detach:
        try:
            pid = start_detached(config, args.start_timeout, *passed)
        except PoolRunningError:  # another server won the race to start
            return _already_running(config, set(given), args.detach)
        print(f"kvflow pool: serving on {config.socket} (pid {pid}); log {config.socket}.log")
        print(f"  clients: kvflow.SharedStore(socket={config.socket!r})")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.cpus:  # the threads started at import (a BLAS's) too; later ones inherit it
        try:
            pin_all_threads(args.cpus)
        except OSError as exc:
            print(f"kvflow serve: --cpus {args.cpus}: {exc.strerror}", file=sys.stderr)
            return 2
    trace.set_role("pool")
    server = PoolServer(config)
    wake, stopping = _wake_on_signals()  # before it serves: a client may stop it at once
    metrics = None
    if args.metrics_port is not None:
        metrics = MetricsEndpoint(server.stats, args.metrics_port, args.metrics_host)
        metrics.start()  # a port taken is refused before the pool starts
    try:
        try:
            server.start()
        except PoolRunningError:
            return _already_running(config, set(given), args.detach)
        except ConfigError as exc:  # named as the option that set it
            if not exc.argument.startswith("disk_"):
                raise
            option = "--" + exc.argument.replace("_", "-")
            print(f"kvflow serve: {option} {exc.value}: {exc.reason}", file=sys.stderr)
            return 2
        print(f"kvflow pool: serving {config.size} bytes on {config.socket} (pid {os.getpid()})")
        print(f"  clients: kvflow.SharedStore(socket={config.socket!r})")
        if metrics is not None:
            print(f"  metrics: {metrics.url}")
        sys.stdout.flush()
        while not (stopping.is_set() or server.wait(0)):
            select.select([wake], [], [], 1.0)  # a signal wakes this at once, then stops
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 64)
        server.stop()
    finally:
        if metrics is not None:
            metrics.stop()
    return 0


def _wake_on_signals() -> tuple[int, threading.Event]:
    """SIGTERM and SIGINT set the returned event (the main loop then stops the server), and
    make the returned descriptor readable. Python runs a signal's handler on the main thread,
    but the kernel may hand the signal to any thread, and then a main thread asleep in a timed
    wait would notice it only when the wait ends: ``stop`` would take up to that long, and a
    client restarting the pool would find the old one still there. The wakeup descriptor is
    written whichever thread got it. The handler only sets the event: it may run in the
    middle of ``PoolServer.start``."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    return read, stopping


def _already_running(config: PoolConfig, asked: set[str], detach: bool) -> int:
    """A pool already serves ``config.socket``: say which. ``--detach`` succeeds (exit 0) if
    it has every setting given; otherwise, and always in the foreground, EXIT_RUNNING."""
    path = config.socket
    stop = f"stop it first (kvflow pool --socket {path} stop) or choose another --socket"
    try:
        running = running_pool(path)
    except StoreError as exc:
        pid = read_pid(path) or "?"
        print(
            f"kvflow serve: a pool already runs on {path} (pid {pid}) but did not answer: {exc}",
            file=sys.stderr,
        )
        return EXIT_RUNNING
    diffs = differences(config, running, asked)
    if detach and not diffs:
        print(f"kvflow pool: already running on {path} ({running.describe()}); nothing started")
        print(f"  clients: kvflow.SharedStore(socket={path!r})")
        return 0
    why = f"; not what was asked: {', '.join(diffs)}" if diffs else ""
    print(
        f"kvflow serve: a pool already runs on {path} ({running.describe()}){why}; {stop}",
        file=sys.stderr,
    )
    return EXIT_RUNNING


def _stats(args: argparse.Namespace) -> int:
    path = check_socket_path(args.socket or default_socket())
    stats = query_stats(path, timeout_s=5.0)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"kvflow pool on {path} (pid {read_pid(path) or '?'})")
    for name, value in stats.items():
        sized = ("capacity", "used", "disk_capacity", "disk_used")
        shown = _size(value) if name in sized else f"{value:,}"
        print(f"  {name:24s} {shown}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    path = check_socket_path(args.socket or default_socket())
    pid = read_pid(path)
    if not pid or not is_serving(path):
        print(f"kvflow pool: no server on {path}", file=sys.stderr)
        return 1
    print(f"kvflow pool: stopping the pool on {path} (pid {pid})", flush=True)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while is_serving(path) or alive(pid):
        if time.monotonic() > deadline:
            print(
                f"kvflow pool: the pool on {path} (pid {pid}) still serves after "
                f"{args.timeout:g} s",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.05)
    print(f"kvflow pool: stopped the pool on {path} (pid {pid})")
    return 0


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / (1 << 30):.2f} GiB)"


def run(args: argparse.Namespace) -> int:
    try:
        code: int = args.handler(args)
    except KVFlowError as exc:
        print(f"kvflow {args.command}: {exc}", file=sys.stderr)
        return 1
    return code
