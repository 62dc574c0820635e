"""The pool restarting under a steady ``vllm serve`` load: what the restart test
(``tests/integrations/vllm/test_serve_restarts.py``) and its benchmark
(``benchmarks/vllm_restarts.py``) share.

Requests are prompts over ``PREFIXES`` shared prefixes, each with its own suffix (request ``i``:
prefix ``i % PREFIXES``), sent ``CONCURRENCY`` at a time, greedy and streamed. ``Scraper`` reads
``/metrics`` every 100 ms on a thread of its own while they run and keeps what it saw.
Standard library and NumPy only, as ``serve``.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow.pool.launch import alive, read_pid
from tests.support.serve import Server, get, parse_metrics, stop_pool, stream_completion

PREFIXES = 4
PREFIX_TOKENS = 256  # four chunks of the connector's default 64 tokens
SUFFIX_TOKENS = 48
MAX_TOKENS = 8
CONCURRENCY = 2
SCRAPE_S = 0.1


def prompt(
    i: int,
    prefixes: int = PREFIXES,
    prefix_tokens: int = PREFIX_TOKENS,
    suffix_tokens: int = SUFFIX_TOKENS,
) -> list[int]:
    """Request ``i``'s tokens: prefix ``i % prefixes``, then its own suffix."""
    prefix = np.random.default_rng(7000 + i % prefixes).integers(3, 1024, prefix_tokens)
    suffix = np.random.default_rng(8000 + i).integers(3, 1024, suffix_tokens)
    return [int(t) for t in np.concatenate([prefix, suffix])]


@dataclass
class Answer:
    index: int
    sent: float  # time.monotonic() when sent
    ttft_s: float
    tokens: list[int]


def ask(
    url: str,
    indices: range,
    fault: Callable[[], object] | None = None,
    prompts: Callable[[int], list[int]] = prompt,
    concurrency: int = CONCURRENCY,
) -> list[Answer]:
    """Requests ``indices`` (``prompts(i)``), ``concurrency`` at a time; with ``fault``, it is
    made (on this thread) once the first of them has answered, while the others are in
    flight."""

    def one(i: int) -> Answer:
        sent = time.monotonic()
        out = stream_completion(url, prompts(i), max_tokens=MAX_TOKENS, timeout=120.0)
        return Answer(i, sent, out["ttft_s"], out["tokens"])

    with ThreadPoolExecutor(max_workers=concurrency) as threads:
        futures: list[Future[Answer]] = [threads.submit(one, i) for i in indices]
        if fault is not None:
            deadline = time.monotonic() + 300.0
            while not any(f.done() for f in futures) and time.monotonic() < deadline:
                time.sleep(0.01)
            fault()
        return [f.result() for f in futures]


@dataclass
class Scraper:
    """``/metrics`` of ``server`` every ``SCRAPE_S`` until ``stop()``: each scrape's series, or
    the error it met."""

    server: Server
    scrapes: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Scraper:
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_S):
            try:
                status, body = get(self.server.port, "/metrics", 10.0, host=self.server.host)
            except (OSError, http.client.HTTPException) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if status != 200:
                self.errors.append(f"/metrics answered {status}")
                continue
            self.scrapes.append((time.monotonic(), parse_metrics(body.decode())))

    def problems(self) -> list[str]:
        """Counters (``_total``) that went down between two scrapes, and any series below 0."""
        out = []
        for (_, a), (t, b) in zip(self.scrapes, self.scrapes[1:], strict=False):
            for name, value in b.items():
                if value < 0:
                    out.append(f"{name} = {value} at {t:.2f}")
                if name.endswith("_total") and value < a.get(name, 0.0):
                    out.append(f"{name} went from {a[name]} to {value} at {t:.2f}")
        return out


def kill_pool_server(socket: str, wait_s: float = 0.0) -> int:
    """SIGKILL the pool server whose pid file sits beside ``socket``, waiting up to ``wait_s``
    for one to run there (a client may be starting it); its pid (0: none)."""
    deadline = time.monotonic() + wait_s
    while True:
        pid = read_pid(socket)
        if pid > 0 and alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return pid
        if time.monotonic() >= deadline:
            return 0
        time.sleep(0.02)


def end_pool(socket: str) -> None:
    """Stop whatever pool server runs on ``socket`` (``kvflow pool stop``, then SIGKILL to the
    one its pid file names if it still runs)."""
    stop_pool(socket)
    kill_pool_server(socket)


def counters(metrics: dict[str, float]) -> dict[str, Any]:
    """The connector's totals that the restart checks compare."""
    names = (
        "vllm:external_prefix_cache_hits_total",
        "vllm:kvflow_loaded_tokens_total",
        "vllm:kvflow_load_failed_tokens_total",
        "vllm:kvflow_saved_tokens_total",
        "vllm:kvflow_lookup_errors_total",
        "vllm:kvflow_save_failed_tokens_total",
    )
    return {n.removeprefix("vllm:"): metrics.get(n, 0.0) for n in names}
