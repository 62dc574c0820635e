"""A herd on one prefix: what the herd test (``tests/integrations/vllm/test_serve_herd.py``)
and its benchmark (``benchmarks/vllm_herd.py``) share.

A long prefix is computed by one ``vllm serve`` instance (the pool keeps it), then a herd of
requests that share it, each with its own suffix, all sent at once to another instance whose
device has never held it. ``herd`` sends them with ``/metrics`` scraped every 100 ms and
returns each answer with what the instance counted meanwhile: the tokens vLLM took from the
connector (``external_prefix_cache_hits``) and from its own prefix cache, and, for
KVFlowConnector, the tokens and bytes it loaded. Standard library and NumPy only, as ``serve``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.support.restarts import Answer, Scraper, ask
from tests.support.serve import Server

PREFIX_TOKENS = 1792  # 28 chunks of the connector's default 64 tokens
SUFFIX_TOKENS = 64
SIZE = 16  # requests in a herd

COUNTED = {
    "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "device_hit_tokens": "vllm:prefix_cache_hits_total",
    "loaded_tokens": "vllm:kvflow_loaded_tokens_total",
    "loaded_bytes": "vllm:kvflow_loaded_bytes_total",
    "load_failed_tokens": "vllm:kvflow_load_failed_tokens_total",
}


def herd_prompt(i: int, prefix: int = 0, prefix_tokens: int = PREFIX_TOKENS) -> list[int]:
    """Request ``i`` of the herd on prefix number ``prefix``: the prefix, then the request's own
    ``SUFFIX_TOKENS``."""
    head = np.random.default_rng(9000 + prefix).integers(3, 1024, prefix_tokens)
    tail = np.random.default_rng(9500 + 1000 * prefix + i).integers(3, 1024, SUFFIX_TOKENS)
    return [int(t) for t in np.concatenate([head, tail])]


def seed(server: Server, prefix: int = 0, prefix_tokens: int = PREFIX_TOKENS) -> Answer:
    """The prefix computed once on ``server`` (request -1 of its herd), which saves it."""
    return ask(server.url, range(-1, 0), prompts=lambda i: herd_prompt(i, prefix, prefix_tokens))[0]


@dataclass
class Herd:
    answers: list[Answer]  # by request
    prefix_tokens: int
    counted: dict[str, float]  # COUNTED's series, their growth over the herd
    scrapes: int
    scrape_errors: list[str]
    scrape_problems: list[str]

    def ttfts_ms(self) -> list[float]:
        return [1000 * a.ttft_s for a in self.answers]

    def copies(self) -> float:
        """The prefix copies the connector gave vLLM over the herd."""
        return self.counted["external_hit_tokens"] / self.prefix_tokens

    def summary(self) -> dict[str, Any]:
        ttfts = sorted(self.ttfts_ms())
        return {
            "ttft_mean_ms": round(float(np.mean(ttfts)), 1),
            "ttft_p99_ms": round(float(np.percentile(ttfts, 99)), 1),
            "ttfts_ms": [round(t, 1) for t in self.ttfts_ms()],
            "copies": round(self.copies(), 3),
            **self.counted,
            "scrapes": self.scrapes,
            "scrape_errors": self.scrape_errors,
            "scrape_problems": self.scrape_problems,
        }


def herd(
    server: Server, prefix: int = 0, size: int = SIZE, prefix_tokens: int = PREFIX_TOKENS
) -> Herd:
    """``size`` requests on prefix ``prefix``, all at once, ``/metrics`` scraped throughout."""
    before = server.metrics()
    with Scraper(server) as scraper:
        answers = ask(
            server.url,
            range(size),
            prompts=lambda i: herd_prompt(i, prefix, prefix_tokens),
            concurrency=size,
        )
    after = server.metrics()
    counted = {k: after.get(n, 0.0) - before.get(n, 0.0) for k, n in COUNTED.items()}
    return Herd(
        answers, prefix_tokens, counted, len(scraper.scrapes), scraper.errors, scraper.problems()
    )
