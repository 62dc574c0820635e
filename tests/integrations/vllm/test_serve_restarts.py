"""The pool restarting while ``vllm serve`` answers a steady load, with Prometheus scraped every
100 ms throughout (``tests/support/restarts.py``).

KVFlowConnector on its defaults (``kv_load_failure_policy: recompute``), vLLM's own prefix
cache off so that every shared chunk comes from the pool. Two pools:

* the shared pool the connector starts itself (on a private socket): ``kvflow pool stop`` while
  requests are in flight, then a SIGKILL of the server that runs then; the connector starts a
  new one each time;
* the same with a disk tier under that pool: the server started after the SIGKILL serves the
  chunks saved before it from disk (read layer by layer), with the same tokens;
* Mooncake: the master killed while requests are in flight, then started again at its address.

Checked: no request fails and every answer has the tokens of an instance without a connector;
every scrape answers, no counter goes down and no series below 0; once the pool is back,
requests hit in it again within a bounded number of rounds; the connector's totals agree with
vLLM's (the tokens it loaded or failed to are the external hits vLLM counted); the shared pool
is left with no lease, open session or pending write.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.pd import running
from tests.support.pools import require_mooncake
from tests.support.processes import REPO
from tests.support.restarts import (
    Answer,
    Scraper,
    ask,
    counters,
    end_pool,
    kill_pool_server,
)
from tests.support.serve import (
    Server,
    kvflow_mooncake_extra,
    kvflow_transfer_config,
    pool_stats,
    serve_args,
    stop_pool,
)
from tests.support.vllm import keep_log
from tests.support.waits import wait_until

PHASE = 8  # requests per phase
RECOVERY_ROUNDS = 4  # distinct phases after the faults, run in turn until one hits in the pool
RECOVERY_S = 90.0  # ... for at most this long (a new pool server starts in seconds)
TOTAL = 3 * PHASE + RECOVERY_ROUNDS * PHASE
ARGS = {"block_size": 32, "num_blocks": 48, "max_model_len": 1024, "prefix_caching": False}


def _server(python: str, model: str, log: Path, **more: Any) -> Server:
    keep_log(log)
    args = [*serve_args(**ARGS, kv_transfer_config=more.pop("config", None)), "--dtype", "float32"]
    return Server(python, model, args, log=log, cwd=str(REPO), **more)


@pytest.fixture(scope="module")
def reference(
    vllm_python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, list[int]]:
    """Every request's tokens from an instance without a connector."""
    server = _server(vllm_python, tiny_model, tmp_path_factory.mktemp("restarts") / "ref.log")
    with running(server):
        return {a.index: a.tokens for a in ask(server.url, range(TOTAL))}


@contextlib.contextmanager
def _pool(kind: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The connector's config, the environment and the two faults for ``kind``."""
    if kind in ("shared", "shared_disk"):
        socket = f"{tmp_path}/pool.sock"
        disk = {"disk_dir": f"{tmp_path}/disk", "disk_capacity": "1GiB"}
        try:
            yield {
                "config": kvflow_transfer_config({"shared": disk} if kind == "shared_disk" else {}),
                "env": {"KVFLOW_POOL_SOCKET": socket},
                # the second kills the server a client started after the first
                "faults": (lambda: stop_pool(socket), lambda: kill_pool_server(socket, 60.0)),
                "socket": socket,
            }
        finally:
            end_pool(socket)
        return
    require_mooncake()
    from kvflow.stores.mooncake.master import MooncakeMaster

    with MooncakeMaster(log=str(tmp_path / "master.log")) as master:
        extra = kvflow_mooncake_extra(master.address, "128MiB")
        yield {"config": kvflow_transfer_config(extra), "faults": (master.stop, master.start)}


def _phase(
    server: Server, indices: range, fault: Callable[[], object] | None = None
) -> tuple[list[Answer], float]:
    """Requests ``indices`` (with ``fault`` made while they run), and the external hits vLLM
    counted meanwhile."""
    key = "vllm:external_prefix_cache_hits_total"
    before = server.metrics().get(key, 0.0)
    answers = ask(server.url, indices, fault)
    return answers, server.metrics().get(key, 0.0) - before


@pytest.mark.parametrize("kind", ["shared", "shared_disk", "mooncake"])
def test_the_pool_restarting_under_load(
    kind: str,
    vllm_python: str,
    tiny_model: str,
    reference: dict[int, list[int]],
    tmp_path: Path,
) -> None:
    with _pool(kind, tmp_path) as pool:
        first, second = pool["faults"]
        server = _server(
            vllm_python, tiny_model, tmp_path / "serve.log",
            config=pool["config"], env=pool.get("env"),
        )  # fmt: skip
        with running(server), Scraper(server) as scraper:
            answers, hits = _phase(server, range(PHASE))
            assert hits > 0  # warm: the pool serves
            started = _pid(pool)
            answers += _phase(server, range(PHASE, 2 * PHASE), first)[0]
            answers += _phase(server, range(2 * PHASE, 3 * PHASE), second)[0]
            recovered, deadline, r = False, time.monotonic() + RECOVERY_S, 0
            while not recovered and time.monotonic() < deadline:
                lo = (3 + r % RECOVERY_ROUNDS) * PHASE  # prompts the reference answered
                round_, hits = _phase(server, range(lo, lo + PHASE))
                answers += round_
                recovered, r = hits > 0, r + 1
            final = _settled(server, pool)
            now = _pid(pool)
            stats = pool_stats(pool["socket"]) if "socket" in pool else {}
        problems, errors = scraper.problems(), scraper.errors
        scrapes = len(scraper.scrapes)

    assert [a.tokens for a in answers] == [reference[a.index] for a in answers]
    assert recovered, f"no request hit in the pool within {RECOVERY_S:g} s after the faults"
    assert errors == [] and problems == [], (errors, problems)
    assert scrapes > 0
    totals = counters(final)
    assert totals["external_prefix_cache_hits_total"] == (
        totals["kvflow_loaded_tokens_total"] + totals["kvflow_load_failed_tokens_total"]
    ), totals
    if kind != "mooncake":
        assert now not in (0, started)  # a new server took over
        assert (stats["leases"], stats["open_sessions"], stats["pending_writes"]) == (0, 0, 0)
    if kind == "shared_disk":  # the last server found the chunks saved before its start on disk,
        assert stats["disk_recovered"] > 0, stats  # and lookups after it hit them there
        assert stats["disk_hits"] > 0 and stats["disk_reads_served"] > 0, stats


def _pid(pool: dict[str, Any]) -> int:
    if "socket" not in pool:
        return 0
    with contextlib.suppress(OSError, ValueError), open(f"{pool['socket']}.pid") as f:
        return int(f.read().strip())
    return 0


def _settled(server: Server, pool: dict[str, Any]) -> dict[str, float]:
    """vLLM's metrics once no request runs (and the shared pool has no session open)."""

    def idle() -> dict[str, float] | None:
        metrics = server.metrics()
        if metrics.get("vllm:num_requests_running", 1) != 0:
            return None
        if "socket" in pool:
            stats = pool_stats(pool["socket"])
            if any(stats[k] for k in ("leases", "open_sessions", "pending_writes")):
                return None
        return metrics

    metrics: dict[str, float] = wait_until(
        idle, timeout=60.0, what="vLLM and the pool idle", interval=0.5
    )
    return metrics
