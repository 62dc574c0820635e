"""``kvflow serve`` and ``kvflow pool stats|stop``: run and inspect the node-local pool."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from kvflow.errors import KVFlowError, PoolRunningError
from kvflow.pool.client import query_stats
from kvflow.pool.launch import EXIT_RUNNING, is_serving, read_pid, start_detached
from kvflow.pool.paths import check_socket_path, default_socket
from kvflow.pool.server import DEFAULT_CAPACITY, DEFAULT_LEASE_TTL_S, PoolConfig, PoolServer

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the node-local shared pool server",
        description="Run a pool server: a shared-memory arena that every kvflow process on this "
        "machine reaches through SharedStore.",
    )
    serve.add_argument("--socket", default="", help=f"socket path (default {default_socket()})")
    serve.add_argument("--capacity", default=DEFAULT_CAPACITY, help="arena size, e.g. 8GiB")
    serve.add_argument(
        "--lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S, help="read lease limit, seconds"
    )
    serve.add_argument(
        "--allow-uid", type=int, action="append", default=[], help="also accept this uid"
    )
    serve.add_argument(
        "--socket-mode",
        type=lambda text: int(text, 8),
        default=0o600,
        help="socket permission bits, octal (0600; other uids need e.g. 0666 and a directory "
        "they may traverse)",
    )
    serve.add_argument("--detach", action="store_true", help="run in the background")
    serve.add_argument("--start-timeout", type=float, default=120.0, help="with --detach")
    serve.set_defaults(handler=_serve)

    pool = commands.add_parser("pool", help="inspect or stop a running pool server")
    pool.add_argument("--socket", default="", help=f"socket path (default {default_socket()})")
    actions = pool.add_subparsers(dest="action", required=True)
    stats = actions.add_parser("stats", help="capacity, use, objects, leases and counters")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(handler=_stats)
    stop = actions.add_parser("stop", help="stop the server (SIGTERM) and wait for it")
    stop.add_argument("--timeout", type=float, default=10.0)
    stop.set_defaults(handler=_stop)


def _serve(args: argparse.Namespace) -> int:
    config = PoolConfig(
        socket=args.socket,
        capacity=args.capacity,
        lease_ttl_s=args.lease_ttl,
        allow_uids=tuple(args.allow_uid),
        socket_mode=args.socket_mode,
    )
    if args.detach:
        pid = start_detached(config, args.start_timeout)
        print(f"kvflow pool: serving on {config.socket} (pid {pid}); log {config.socket}.log")
        print(f"  clients: kvflow.SharedStore(socket={config.socket!r})")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = PoolServer(config)
    try:
        server.start()
    except PoolRunningError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return EXIT_RUNNING
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    print(f"kvflow pool: serving {config.size} bytes on {config.socket} (pid {os.getpid()})")
    print(f"  clients: kvflow.SharedStore(socket={config.socket!r})", flush=True)
    while not server.wait(1.0):
        pass
    return 0


def _stats(args: argparse.Namespace) -> int:
    path = check_socket_path(args.socket or default_socket())
    stats = query_stats(path, timeout_s=5.0)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"kvflow pool on {path} (pid {read_pid(path) or '?'})")
    for name, value in stats.items():
        shown = f"{value:,}" if name not in ("capacity", "used") else _size(value)
        print(f"  {name:24s} {shown}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    path = check_socket_path(args.socket or default_socket())
    pid = read_pid(path)
    if not pid or not is_serving(path):
        print(f"kvflow pool: no server on {path}", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while is_serving(path) or _alive(pid):
        if time.monotonic() > deadline:
            print(f"kvflow pool: pid {pid} still serving after {args.timeout:g} s", file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"kvflow pool: stopped pid {pid}")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / (1 << 30):.2f} GiB)"


def run(args: argparse.Namespace) -> int:
    try:
        code: int = args.handler(args)
    except KVFlowError as exc:
        print(f"kvflow {args.command}: {exc}", file=sys.stderr)
        return 1
    return code
