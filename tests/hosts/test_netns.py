"""The test network itself (``kvflow.testing.netns``): hosts reach each other and nothing else,
a partition cuts a host off both ways, and every namespace, link and process is removed, also
when the maker dies without closing."""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvflow.testing import netns
from kvflow.testing.netns import Network
from tests.support.hosts import require_hosts

CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__); sys.exit(1)\n"
)
LISTEN = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen()\n"
    "print('up', flush=True)\n"
    "while True: s.accept()\n"
)


def namespaces(network: str) -> set[str]:
    """The namespaces of one network (by its name): other test workers make and remove
    networks of their own meanwhile, so only these are compared."""
    root = Path("/run/netns")
    ours = re.compile(rf"{re.escape(network)}(sw|h\d+)")
    return {p.name for p in root.iterdir() if ours.fullmatch(p.name)} if root.is_dir() else set()


def connects(net: Network, src: int, address: str, timeout: float = 2.0) -> bool:
    argv = net[src].command([sys.executable, "-c", CONNECT, address, "5000", str(timeout)])
    return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0


def listen(net: Network, host: int, log: Path) -> subprocess.Popen[bytes]:
    proc = net[host].popen([sys.executable, "-c", LISTEN, net[host].address], log=log)
    end = time.monotonic() + 60.0
    while b"up" not in (log.read_bytes() if log.exists() else b""):
        assert proc.poll() is None and time.monotonic() < end, log.read_text()
        time.sleep(0.02)
    return proc


def test_hosts_reach_each_other_and_a_partition_cuts_one_off(tmp_path: Path) -> None:
    require_hosts()
    with Network(3) as net:
        assert [h.address for h in net] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        assert namespaces(net.name) == {f"{net.name}{n}" for n in ("sw", "h0", "h1", "h2")}
        listen(net, 0, tmp_path / "listen.out")
        received = net[0].link_bytes()[0]
        assert connects(net, 1, net[0].address) and connects(net, 2, net[0].address)
        assert net[0].link_bytes()[0] > received  # counted on host 0's link
        # a host has a route to the other hosts and to nothing else
        for host in net:
            routes = subprocess.run(
                ["ip", "-n", host.netns, "route", "show"], capture_output=True, text=True,
                timeout=30, check=True,
            ).stdout.splitlines()  # fmt: skip
            assert [r.split()[0] for r in routes] == ["198.18.0.0/24"], routes
        net[2].partition()
        assert not connects(net, 2, net[0].address, timeout=1.0)
        assert connects(net, 1, net[0].address)
        net[2].heal()
        assert connects(net, 2, net[0].address)
    assert namespaces(net.name) == set()


def test_close_kills_what_runs_on_the_hosts_and_removes_everything(tmp_path: Path) -> None:
    require_hosts()
    net = Network(2)
    assert len(namespaces(net.name)) == 3
    proc = listen(net, 1, tmp_path / "listen.out")
    grandchild = net[0].popen(["sh", "-c", "sleep 600 & wait"])
    net.close()
    assert proc.poll() is not None and grandchild.poll() is not None
    assert namespaces(net.name) == set()


def test_a_dead_makers_network_is_swept(tmp_path: Path) -> None:
    """A process that made a network and died without closing it: the next network made (or
    ``sweep()``) removes its namespaces and what ran in them."""
    require_hosts()
    script = (
        "import os, sys\n"
        "from kvflow.testing.netns import Network\n"
        "net = Network(2)\n"
        "net[1].popen(['sleep', '600'])\n"
        "print(net.name, flush=True)\n"
        "os._exit(0)\n"
    )
    made = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    name = made.stdout.strip()
    assert namespaces(name) == {f"{name}sw", f"{name}h0", f"{name}h1"}
    removed = netns.sweep()
    assert set(removed) >= {f"{name}sw", f"{name}h0", f"{name}h1"}
    assert namespaces(name) == set()


@pytest.mark.parametrize("hosts", [0, -1, 65, 2.0, True, "2"])
def test_bad_host_counts_are_refused(hosts: object) -> None:
    with pytest.raises(ValueError, match=r"hosts must be an int in \[1, 64\], got"):
        Network(hosts)  # type: ignore[arg-type]


def test_impair_refuses_bad_values_or_says_netem_is_missing() -> None:
    require_hosts()
    with Network(1) as net:
        with pytest.raises(ValueError, match="loss must be a fraction"):
            net[0].impair(loss=2)
        with pytest.raises(ValueError, match="delay_ms must be >= 0"):
            net[0].impair(delay_ms=-1)
        if not netns.has_netem():
            with pytest.raises(netns.NetworkError, match="netem"):
                net[0].impair(delay_ms=5)


def test_uplinked_networks_take_their_own_subnets_and_leave_no_route(tmp_path: Path) -> None:
    """This process reaches an uplinked network's hosts; two at once do not overlap; closing
    one removes its link and route from this namespace at once."""
    require_hosts()
    with Network(2, uplink=True) as one, Network(1, uplink=True) as two:
        assert not one.subnet.overlaps(two.subnet)
        assert {ipaddress.ip_address(a) for a in (one[0].address, one.uplink_address)} <= set(
            one.subnet
        )
        listen(one, 1, tmp_path / "listen.out")
        socket.create_connection((one[1].address, 5000), timeout=5.0).close()
        subnets = {str(one.subnet), str(two.subnet)}
        assert subnets <= _routes()
    assert not subnets & _routes()


def _routes() -> set[str]:
    out = subprocess.run(
        ["ip", "route", "show"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return {line.split()[0] for line in out.splitlines()}
