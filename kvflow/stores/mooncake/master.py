"""A ``mooncake_master`` process on this machine: for one-node deployments, benchmarks and tests.

``MooncakeMaster()`` starts the master that the ``kvflow[mooncake]`` wheel installs, listening on
127.0.0.1 at a free port (no HTTP metadata server: clients use ``P2PHANDSHAKE``), and waits until
it accepts connections. ``stop()`` ends it; ``start()`` again brings it back at the same address
(with empty metadata, as after any master restart).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from types import TracebackType

from kvflow.errors import MissingDependencyError, StoreUnavailableError

__all__ = ["MooncakeMaster", "find_master_binary"]


def find_master_binary() -> str | None:
    """``mooncake_master`` on PATH, or beside this Python (a virtual environment's bin)."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return beside if os.access(beside, os.X_OK) else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class MooncakeMaster:
    """A ``mooncake_master`` child process on ``host`` (ports chosen free unless given).

    ``extra`` adds command-line flags (``--default_kv_lease_ttl=...``). Output goes to ``log``
    (a path) or is discarded.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *extra: str,
        log: str | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        binary = find_master_binary()
        if binary is None:
            raise MissingDependencyError("mooncake_master", "'kvflow[mooncake]'")
        self.binary = binary
        self.host = host
        self.port = port or free_port(host)
        self.extra = extra
        self.log = log
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        """``host:port``, what ``MooncakeConfig.master_server_address`` takes."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the master (again) at ``address``; returns once it accepts connections."""
        if self.running:
            return
        cmd = [
            self.binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={free_port(self.host)}",
            *self.extra,
        ]
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        finally:
            if self.log:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex((self.host, self.port)) == 0:
                    return
            time.sleep(0.05)
        code = self.proc.poll()
        self.stop()
        raise StoreUnavailableError(
            f"mooncake_master did not listen on {self.address} within "
            f"{self.start_timeout_s:g} s (exit code {code})"
        )

    def stop(self) -> None:
        """Kill the master (it keeps nothing worth a graceful stop) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    kill = stop

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"MooncakeMaster({self.address!r}, running={self.running})"
