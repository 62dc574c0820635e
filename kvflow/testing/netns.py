"""Hosts on one machine: Linux network namespaces joined by a bridge, for multi-host tests and
benchmarks of pools that span hosts (Mooncake's master on one, clients on the others).

``Network(3)`` makes a *switch* namespace holding a bridge and three host namespaces, each
joined to the bridge by a veth pair (``eth0`` in the host, ``h<i>`` on the bridge), with its
own address in 198.18.0.0/15 (set aside for network benchmarks) and its loopback up. Nothing is
made in the caller's own namespace and no route leads out of the network: traffic goes only
between its hosts. Every network is isolated from every other, so networks made at once (test
workers in parallel) may use the same addresses.

* ``host.popen(argv)`` runs a process on a host (``ip netns exec``), in a process group of its
  own; ``host.kill()`` kills every process in the host's namespace (a host's crash).
* ``host.partition()`` / ``host.heal()`` take the host's cable out and put it back (its port on
  the bridge down and up: nothing passes either way meanwhile).
* ``host.limit("200mbit")`` caps the host's link both ways (a token bucket); ``host.unlimit()``.
* ``host.link_bytes()`` is what went through the host's ``eth0``: ``(received, sent)``.
* ``Network(n, uplink=True)`` also joins the caller's namespace to the bridge (a veth whose
  root end has ``network.uplink_address``), so that the test process itself can reach servers
  on the hosts (``vllm serve``): such a network takes a /24 of 198.19.0.0/16 no other uplinked
  network on this machine uses, and the hosts can reach the caller at that address too.
* ``close()`` (or the end of a ``with`` block) kills every process left in the network's
  namespaces and deletes them, links included, also after a failure. ``sweep()`` removes what a
  crashed process of this kind left behind (namespaces named for a pid no longer alive).

It needs root and ``ip`` (iproute2), and ``tc`` for ``limit``; ``unavailable()`` says why a
machine cannot run it (``None`` when it can). This kernel's ``tc`` may lack ``netem`` (delay,
loss): ``has_netem()`` says, and ``impair(delay_ms=..., loss=...)`` raises ``NetworkError``
naming what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvflow.pool.launch import alive

__all__ = ["Host", "Network", "NetworkError", "unavailable"]

SUBNET = ipaddress.ip_network("198.18.0.0/24")
"""The hosts' addresses: ``198.18.0.1`` for host 0, and on (a /24 of 198.18.0.0/15)."""
UPLINKED = ipaddress.ip_network("198.19.0.0/16")
"""Where uplinked networks take their /24s (seen from the caller's namespace, they must not
overlap)."""
_UPLINK_LOCK = "/run/kvflow-netns.lock"
MAX_HOSTS = 64
_PREFIX = "kvfn"  # namespaces: kvfn<pid>x<n>sw (the switch), kvfn<pid>x<n>h<i> (hosts)
_COUNTER = itertools.count()
_COMMAND_TIMEOUT_S = 30.0


class NetworkError(RuntimeError):
    """A namespace, link or queue could not be made or changed; names the command and why."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    return _run(["ip", *(["-n", netns] if netns else []), *args], check=check)


def _run(argv: Sequence[str], check: bool = True) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why this machine cannot make test networks, or ``None`` if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (multi-host tests run as root in CI)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"{_PREFIX}{os.getpid()}xprobe"
    try:
        _ip("netns", "add", name)
    except NetworkError as exc:
        return f"cannot make a network namespace: {exc}"
    _ip("netns", "del", name, check=False)
    return None


def has_netem() -> bool:
    """Whether ``tc`` can add the ``netem`` queue (delay, loss) on this kernel."""
    if shutil.which("tc") is None or unavailable() is not None:
        return False
    with Network(1) as net:
        try:
            net.hosts[0].impair(delay_ms=1)
        except NetworkError:
            return False
    return True


def _namespace_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


class Host:
    """One host of a ``Network``: a namespace with ``eth0`` at ``address``."""

    def __init__(self, network: Network, index: int) -> None:
        self.network = network
        self.index = index
        self.netns = f"{network.name}h{index}"
        self.port = f"h{index}"  # its end on the bridge, in the switch namespace
        self.address = str(network.subnet.network_address + 1 + index)
        self.processes: list[subprocess.Popen[bytes]] = []

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(
        self,
        argv: Sequence[str],
        *,
        log: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this host in a process group of its own, output to ``log`` (or
        discarded); ``close()`` kills it if it still runs."""
        out: Any = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                self.command(argv), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
            )  # fmt: skip
        finally:
            if log:
                out.close()
        self.processes.append(proc)
        return proc

    def kill(self, timeout_s: float = 30.0) -> None:
        """SIGKILL every process on this host, as a crash would, and wait until they are gone."""
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        while True:
            pids = _namespace_pids(self.netns)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for proc in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.05)
            if not pids and all(p.poll() is not None for p in self.processes):
                return
            if time.monotonic() > deadline:
                raise NetworkError(f"processes {pids} on {self.netns} outlived SIGKILL")
            time.sleep(0.05)

    def partition(self) -> None:
        """Cut this host off: its port on the bridge goes down (nothing passes either way)."""
        _ip("link", "set", self.port, "down", netns=self.network.switch)

    def heal(self) -> None:
        _ip("link", "set", self.port, "up", netns=self.network.switch)

    def limit(self, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
        """Cap the link to ``rate`` (``tc`` units: ``200mbit``) both ways, a token bucket."""
        for netns, dev in ((self.netns, "eth0"), (self.network.switch, self.port)):
            _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                  rate, "burst", burst, "latency", latency])  # fmt: skip

    def impair(self, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """Delay (ms) and loss (a fraction) on the link both ways; needs ``netem``."""
        if not 0.0 <= loss <= 1.0:
            raise ValueError(f"loss must be a fraction in [0, 1], got {loss!r}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms!r}")
        for netns, dev in ((self.netns, "eth0"), (self.network.switch, self.port)):
            _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "netem",
                  "delay", f"{delay_ms}ms", "loss", f"{100 * loss}%"])  # fmt: skip

    def unlimit(self) -> None:
        for netns, dev in ((self.netns, "eth0"), (self.network.switch, self.port)):
            _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)

    def link_bytes(self) -> tuple[int, int]:
        """Bytes ``(received, sent)`` through this host's ``eth0`` so far."""
        out = _ip("-s", "-j", "link", "show", "eth0", netns=self.netns)
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.address}, netns={self.netns!r})"


class Network:
    """``hosts`` hosts on one bridge; see the module's docstring."""

    def __init__(self, hosts: int, *, uplink: bool = False) -> None:
        if not isinstance(hosts, int) or isinstance(hosts, bool) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an int in [1, {MAX_HOSTS}], got {hosts!r}")
        reason = unavailable()
        if reason is not None:
            raise NetworkError(reason)
        sweep()
        number = next(_COUNTER)
        self.name = f"{_PREFIX}{os.getpid()}x{number}"
        self.switch = f"{self.name}sw"
        self.subnet = SUBNET
        self.uplink_address: str | None = None
        self._uplink_device: str | None = None
        self.hosts: list[Host] = []
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            if uplink:
                self._add_uplink(f"kv{os.getpid()}u{number}")
            for i in range(hosts):
                self._add_host(Host(self, i))
        except BaseException:
            self.close()
            raise

    def _add_uplink(self, device: str) -> None:
        """A veth from the caller's namespace to the bridge, on a /24 of ``UPLINKED`` that no
        route of the caller's namespace covers yet (chosen under a lock, as other processes
        may be choosing at once). Deleting the switch namespace deletes the veth and its
        route with it."""
        with open(_UPLINK_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = {
                ipaddress.ip_network(route["dst"])
                for route in json.loads(_ip("-j", "route", "show") or "[]")
                if route.get("dst", "default")[0].isdigit()
            }
            free = (
                s for s in UPLINKED.subnets(new_prefix=24) if not any(s.overlaps(t) for t in taken)
            )
            subnet = next(free, None)
            if subnet is None:
                raise NetworkError(f"every /24 of {UPLINKED} is routed already")
            self.subnet = subnet
            self.uplink_address = str(subnet.network_address + 254)
            self._uplink_device = device
            _ip("link", "add", device, "type", "veth", "peer", "name", "uplink",
                "netns", self.switch)  # fmt: skip
            _ip("link", "set", "uplink", "master", "br0", "up", netns=self.switch)
            _ip("addr", "add", f"{self.uplink_address}/24", "dev", device)
            _ip("link", "set", device, "up")

    def _add_host(self, host: Host) -> None:
        self.hosts.append(host)
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns",
            host.netns, netns=self.switch)  # fmt: skip
        _ip("link", "set", host.port, "master", "br0", "up", netns=self.switch)
        _ip(
            "addr",
            "add",
            f"{host.address}/{self.subnet.prefixlen}",
            "dev",
            "eth0",
            netns=host.netns,
        )
        _ip("link", "set", "eth0", "up", netns=host.netns)
        _ip("link", "set", "lo", "up", netns=host.netns)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def close(self) -> None:
        """Kill every process on the network's hosts, then delete its namespaces and links."""
        errors = []
        for host in self.hosts:
            try:
                host.kill()
            except NetworkError as exc:
                errors.append(str(exc))
        if self._uplink_device is not None:  # at once: a namespace's links go only later
            _ip("link", "del", self._uplink_device, check=False)
            self._uplink_device = None
        for netns in [h.netns for h in self.hosts] + [self.switch]:
            _ip("netns", "del", netns, check=False)
        self.hosts = []
        if errors:
            raise NetworkError("; ".join(errors))

    def __enter__(self) -> Network:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def sweep() -> list[str]:
    """Delete the namespaces of networks whose maker died without closing them (processes left
    in them are killed first); returns their names."""
    root = Path("/run/netns")
    removed = []
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        owner = name[len(_PREFIX) :].split("x", 1)[0]
        if not owner.isdigit() or alive(int(owner)):
            continue
        for pid in _namespace_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed
