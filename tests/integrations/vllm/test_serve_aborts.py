"""Aborted requests in a real ``vllm serve`` with KVFlowConnector on a private shared pool.

Many streaming requests share a prefix (vLLM's own prefix cache off: every shared chunk is
loaded from the pool, every new one saved), so loads and saves are in flight when clients go
away: some close the connection after the first streamed token, some time out before it (the
request still waiting or prefilling), the rest complete. Afterwards the server must still
serve (the same greedy tokens as before the aborts), the pool must hold no lease, open session
or pending write, and vLLM must have freed every block and request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.pools import pool_server
from tests.support.processes import REPO
from tests.support.serve import (
    Server,
    kvflow_transfer_config,
    labelled,
    pool_stats,
    serve_args,
    stream_completion,
)
from tests.support.vllm import POOL_TIMEOUT_S, keep_log

BLOCK = 32
ABORTED_MAX = 200  # tokens an aborted request asks for
DRAIN_S = 60.0  # for the pool's sessions and vLLM's requests to end after the last client


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1024, n)]


PREFIX = _tokens(320, 10)  # 10 chunks every request shares
PROMPTS = [PREFIX + _tokens(96, 100 + i) for i in range(12)]
FRESH = PREFIX + _tokens(64, 99)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[str]:
    """A pool server on a private socket, on threads of this process."""
    with pool_server(f"{tmp_path}/pool.sock", "128MiB"):
        yield f"{tmp_path}/pool.sock"


@pytest.fixture
def served(vllm_python: str, tiny_model: str, pool: str, tmp_path: Path) -> Iterator[Server]:
    extra = {"chunk_blocks": 1, "shared": {"socket": pool, "timeout_s": POOL_TIMEOUT_S}}
    args = serve_args(
        block_size=BLOCK,
        num_blocks=48,  # device KV: 1536 tokens; the requests below need ~5000
        max_model_len=1024,
        kv_transfer_config=kvflow_transfer_config(extra),
        prefix_caching=False,  # every shared chunk comes from the pool
    )
    keep_log(tmp_path / "serve.log")  # its tail in the report if the test fails
    server = Server(vllm_python, tiny_model, args, log=tmp_path / "serve.log", cwd=str(REPO))
    try:
        server.ready()
        yield server
    finally:
        server.stop()


def _send(url: str, i: int) -> dict[str, Any]:
    """Request i: every third completes, every third goes away after its first token, every
    third goes away 50 ms after sending (before its first token, or at least long before its
    last)."""
    prompt = PROMPTS[i]
    if i % 3 == 0:
        return stream_completion(url, prompt, max_tokens=24)
    if i % 3 == 1:
        return stream_completion(url, prompt, max_tokens=ABORTED_MAX, abort_after_first=True)
    return stream_completion(url, prompt, max_tokens=ABORTED_MAX, abort_after_s=0.05)


def _settled(server: Server, socket: str) -> tuple[dict[str, float], dict[str, int]]:
    """vLLM's metrics and the pool's counters, once no request runs and no pool session is
    open, or as they are after ``DRAIN_S``."""
    deadline = time.monotonic() + DRAIN_S
    while True:
        metrics, stats = server.metrics(), pool_stats(socket)
        idle = metrics.get("vllm:num_requests_running", 1) == 0 and not any(
            stats[k] for k in ("leases", "open_sessions", "pending_writes")
        )
        if idle or time.monotonic() > deadline:
            return metrics, stats
        time.sleep(0.5)


def test_aborted_requests_leak_nothing(served: Server, pool: str) -> None:
    before = stream_completion(served.url, FRESH, max_tokens=8)
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as threads:
        results = list(threads.map(lambda i: _send(served.url, i), range(len(PROMPTS))))
    aborted = sum(r["aborted"] for r in results)
    completed = [r for r in results if not r["aborted"]]
    assert aborted >= 4 and len(completed) == 4
    assert all(len(r["tokens"]) == 24 for r in completed)

    after = stream_completion(served.url, FRESH, max_tokens=8)
    assert after["tokens"] == before["tokens"]

    metrics, stats = _settled(served, pool)
    # vLLM stopped the requests whose clients went away: without the aborts it would have
    # generated every token asked for (it counts no finish reason "abort" in /metrics)
    asked = sum(len(r["tokens"]) for r in completed) + 2 * 8 + (len(PROMPTS) - 4) * ABORTED_MAX
    assert metrics["vllm:generation_tokens_total"] < asked - (len(PROMPTS) - 4) * ABORTED_MAX // 2
    # every completed request counted; an aborted one only where vLLM wrote its last token
    # before it read the close (it notices a client gone at its next write, which under load
    # may come late), so not every abort may show here, but most must
    finished = labelled(metrics, "vllm:request_success_total", finished_reason="length")
    assert 6 <= finished <= 6 + aborted // 4, (finished, aborted)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0  # no prefix cache: every block freed
    assert (stats["leases"], stats["open_sessions"], stats["pending_writes"]) == (0, 0, 0)
    # the pool served loads: the shared prefix came from it, not from vLLM
    assert stats["hits"] > 0
    assert metrics["vllm:external_prefix_cache_hits_total"] > 0
