"""``kvflow serve --metrics-port``: the pool's counters for Prometheus, over real HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvflow
from kvflow.errors import MissingDependencyError
from kvflow.pool import protocol as p
from kvflow.pool.metrics import METRICS, require_client
from tests.support.processes import REPO, ServeProcess
from tests.support.waits import wait_until


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def pool_stats(path: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-m", "kvflow", "pool", "--socket", path, "stats", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    stats: dict[str, int] = json.loads(out)
    return stats


def test_every_pool_stat_is_a_metric_with_a_conventional_name() -> None:
    assert sorted(m.stat for m in METRICS) == sorted(p.STATS_FIELDS)
    for m in METRICS:
        assert m.name.startswith("kvflow_pool_") and not m.name.endswith("_total")
        assert m.kind in ("counter", "gauge")
        assert ("_ms" not in m.name) and (m.stat != "capacity" or m.name.endswith("_bytes"))


def test_scrape_after_traffic_matches_pool_stats(
    sock_dir: str, serve: Callable[..., ServeProcess]
) -> None:
    path = f"{sock_dir}/pool.sock"
    port = free_port()
    server = serve(path, "4MiB", "--metrics-port", str(port), "--idle-timeout", "30")
    wait_until(lambda: f"127.0.0.1:{port}/metrics" in server.log(), 60, "the metrics line")
    # the readiness probe's connection counts until the server has read its end
    wait_until(lambda: pool_stats(path)["clients"] == 1, 60, "the probe to be gone")
    store = kvflow.SharedStore(socket=path)
    try:
        session = store.open_write(["a", "b"], 8192)
        store.finish_write(session, np.ones(2, dtype=bool))
        assert store.lookup(["a", "b", "c"]).tolist() == [True, True, False]
        reading = store.open_read(["a", "missing"])
        # the store alone: the server has read the end of the last stats command's connection
        # (it notices that on a thread of its own)
        metrics = wait_until(
            lambda: m if (m := scrape(port))["kvflow_pool_clients"] == 1 else None,
            60,
            "the server to see the earlier stats client go",
        )
        stats = pool_stats(path)  # one request more than the scrape saw, one client more
        store.close_read(reading)
    finally:
        store.close()
    assert metrics["kvflow_pool_hits_total"] == stats["hits"] > 0
    assert metrics["kvflow_pool_misses_total"] == stats["misses"] > 0
    assert metrics["kvflow_pool_objects"] == stats["objects"] == 2
    assert metrics["kvflow_pool_used_bytes"] == stats["used"] > 0
    assert metrics["kvflow_pool_capacity_bytes"] == stats["capacity"] == 4 << 20
    assert metrics["kvflow_pool_leases"] == stats["leases"] == 1
    assert metrics["kvflow_pool_pending_writes"] == stats["pending_writes"] == 0
    assert metrics["kvflow_pool_evictions_total"] == stats["evictions"]
    assert metrics["kvflow_pool_refused_connections_total"] == stats["refused_limit"] == 0
    assert metrics["kvflow_pool_idle_timeout_seconds"] == 30.0
    assert metrics["kvflow_pool_max_clients"] == stats["max_clients"]
    assert metrics["kvflow_pool_clients"] == 1 and stats["clients"] == 2
    assert metrics["kvflow_pool_connections_total"] + 1 == stats["clients_total"]
    assert metrics["kvflow_pool_requests_total"] + 1 == stats["requests"]


def test_metrics_port_taken_is_refused_by_name(sock_dir: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        path = f"{sock_dir}/pool.sock"
        cmd = [sys.executable, "-m", "kvflow", "serve", "--socket", path, "--capacity", "4MiB"]
        run = subprocess.run(
            [*cmd, "--metrics-port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 1
    assert f"--metrics-port={port}" in run.stderr and "cannot serve" in run.stderr


def test_without_prometheus_client_the_option_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MissingDependencyError, match=r"kvflow\[metrics\]"):
        require_client()
