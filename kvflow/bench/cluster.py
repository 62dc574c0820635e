"""A Mooncake pool across the hosts of a test network (``kvflow.testing.netns``): the master on
host 0, ``kvflow.bench.hostload`` workers on the others. Used by ``kvflow bench hosts`` and the
multi-host tests.

``Cluster(hosts, directory)`` makes the network and starts ``mooncake_master`` on host 0 (its
log in ``directory``); ``worker(host, tag, name, **args)`` starts a worker process on a host,
given the master's address, the host's own address and the cluster's key prefix;
``kill_master()`` / ``start_master()`` stop it (SIGKILL) and bring it back at the same address.
``close()`` kills everything on every host and removes the network. With ``uplink=True`` this
process reaches the hosts too (``Network``'s uplink), for servers it talks to itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import TracebackType
from typing import Any

from kvflow.errors import MissingDependencyError
from kvflow.stores.mooncake.master import find_master_binary
from kvflow.testing.netns import Host, Network, NetworkError

__all__ = ["Cluster", "HostWorker"]

MASTER_PORT = 50051


def _listening(pid: int, port: int) -> bool:
    """Whether a socket in ``pid``'s network namespace listens on ``port`` (IPv4)."""
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return False
    for row in rows:
        fields = row.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            return True
    return False


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


class HostWorker:
    """A ``kvflow.bench.hostload`` process on a host, reporting into files of the cluster's
    directory: ``<tag>.ready``, ``<tag>.json``, its output in ``<tag>.out``."""

    def __init__(self, host: Host, directory: str, tag: str, name: str, args: dict[str, Any]):
        self.host = host
        self.tag = tag
        self.ready_path = os.path.join(directory, f"{tag}.ready")
        self.result_path = os.path.join(directory, f"{tag}.json")
        self.log_path = os.path.join(directory, f"{tag}.out")
        args = {**args, "ready": self.ready_path, "result": self.result_path}
        argv = [sys.executable, "-m", "kvflow.bench.hostload", name, json.dumps(args)]
        self.proc = host.popen(argv, log=self.log_path)

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready_path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.tag} exited early: {self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.tag} not ready in {timeout:g} s")
            time.sleep(0.02)
        with open(self.ready_path) as f:
            ready: dict[str, Any] = json.load(f)
        return ready

    def result(self, timeout: float = 120.0) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(
                f"worker {self.tag} ran past {timeout:g} s: {self.output()}"
            ) from None
        if code != 0 or not os.path.exists(self.result_path):
            raise RuntimeError(f"worker {self.tag} exited with {code}: {self.output()}")
        with open(self.result_path) as f:
            result: dict[str, Any] = json.load(f)
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)

    def output(self) -> str:
        return _tail(self.log_path)


class Cluster:
    """``hosts`` hosts (host 0 runs the master); see the module's docstring."""

    def __init__(
        self,
        hosts: int,
        directory: str,
        *master_flags: str,
        prefix: str = "hosts/",
        uplink: bool = False,
    ) -> None:
        binary = find_master_binary()
        if binary is None:
            raise MissingDependencyError("mooncake_master", "'kvflow[mooncake]'")
        self.binary = binary
        self.directory = directory
        self.master_flags = master_flags
        self.prefix = prefix
        self.workers: list[HostWorker] = []
        self.net = Network(hosts, uplink=uplink)
        self.master: subprocess.Popen[bytes] | None = None
        try:
            self.start_master()
        except BaseException:
            self.net.close()
            raise

    @property
    def master_host(self) -> Host:
        return self.net[0]

    @property
    def master_address(self) -> str:
        return f"{self.master_host.address}:{MASTER_PORT}"

    def start_master(self, timeout: float = 30.0) -> None:
        host = self.master_host
        argv = [
            self.binary, f"--rpc_address={host.address}", f"--rpc_port={MASTER_PORT}",
            f"--metrics_host={host.address}", f"--metrics_port={MASTER_PORT + 1}",
            *self.master_flags,
        ]  # fmt: skip
        self.master = proc = host.popen(argv, log=os.path.join(self.directory, "master.log"))
        deadline = time.monotonic() + timeout
        while not _listening(proc.pid, MASTER_PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(30)
                log = _tail(os.path.join(self.directory, "master.log"))
                raise NetworkError(f"mooncake_master did not listen on {host}: {log}")
            time.sleep(0.02)

    def kill_master(self) -> None:
        """SIGKILL the master (its metadata is lost, as in a crash) and reap it."""
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
        if self.master is not None:
            self.master.wait(30)

    def worker(self, host: int, tag: str, name: str, /, **args: Any) -> HostWorker:
        """Start a ``kvflow.bench.hostload`` worker on host ``host``."""
        h = self.net[host]
        args = {"master": self.master_address, "address": h.address, "prefix": self.prefix, **args}
        worker = HostWorker(h, self.directory, tag, name, args)
        self.workers.append(worker)
        return worker

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.net.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
