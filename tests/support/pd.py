"""What the P/D serving tests share (``tests/integrations/vllm/test_pd.py`` on one machine,
``test_pd_hosts.py`` across hosts): the prompts, starting ``vllm serve`` instances, asking them
four at a time, and the checks of a producer/consumer pair's answers and counters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.processes import REPO
from tests.support.serve import Server, pool_stats, serve_args, stream_completion
from tests.support.vllm import keep_log

BLOCK = 32
CHUNK_TOKENS = 64  # the connector's default: 2 blocks of 32
MAX_TOKENS = 12
CONCURRENCY = 4
ARGS = {"block_size": BLOCK, "num_blocks": 64, "max_model_len": 1024}  # device KV: 2048 tokens


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1024, n)]


PROMPTS = [tokens(200 + 37 * i, 500 + i) for i in range(8)]  # 200..459 tokens
DIRECT = tokens(330, 599)  # sent to the consumer without a prefill
DOWN = tokens(280, 598)  # sent through the proxy with the pool stopped


def chunked(prompt: list[int]) -> int:
    """The tokens of a prompt's whole blocks, short of its last token (what a hit can be: whole
    chunks, then a tail)."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def stored(prompt: list[int]) -> int:
    """The tokens of a prompt's whole blocks (what its prefill saves: whole chunks and a tail;
    none of ``PROMPTS`` ends on a block, which would add the tail one block shorter)."""
    return len(prompt) // BLOCK * BLOCK


def whole_chunks(prompt: list[int]) -> int:
    """The tokens of a prompt's whole chunks (what a consumer counts as not stored)."""
    return len(prompt) // CHUNK_TOKENS * CHUNK_TOKENS


def answers(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as threads:
        results = threads.map(lambda p: stream_completion(url, p, max_tokens=MAX_TOKENS), prompts)
        return [r["tokens"] for r in results]


def start(python: str, model: str, tmp: Path, name: str, **more: Any) -> Server:
    """An instance for these tests; ``more`` goes to ``serve_args``, but ``host`` and
    ``prefix`` (another host's) and ``env`` to ``Server``."""
    log = tmp / f"{name}.log"
    keep_log(log)
    where = {k: more.pop(k) for k in ("host", "prefix", "env") if k in more}
    args = [*serve_args(**ARGS, **more), "--dtype", "float32"]  # tokens exact across paths
    return Server(python, model, args, log=log, cwd=str(REPO), **where)


@contextlib.contextmanager
def running(*servers: Server) -> Iterator[None]:
    """Wait for servers started together; stop them all however the test ends."""
    try:
        for server in servers:
            server.ready()
        yield
    finally:
        for server in servers:
            server.stop()


def reference_answers(python: str, model: str, tmp: Path) -> dict[str, list[list[int]]]:
    """The greedy tokens of one instance without a connector, asked as the P/D pair is."""
    server = start(python, model, tmp, "reference")
    with running(server):
        return {
            "prompts": answers(server.url, PROMPTS),
            "direct": answers(server.url, [DIRECT]),
            "down": answers(server.url, [DOWN]),
        }


def check_pairing(
    answered: list[list[int]],
    reference: dict[str, list[list[int]]],
    decoded: dict[str, float],
    prefilled: dict[str, float],
) -> None:
    """The proxy's answers are the single instance's; the consumer hit every whole block of
    every prompt but the last token's and saved nothing, the producer saved every whole block."""
    assert answered == reference["prompts"]
    prompt_tokens = sum(len(p) for p in PROMPTS)
    assert decoded["vllm:prompt_tokens_total"] == prompt_tokens
    assert decoded["vllm:external_prefix_cache_hits_total"] == sum(map(chunked, PROMPTS))
    assert decoded["vllm:kvflow_load_failed_tokens_total"] == 0
    assert decoded["vllm:kvflow_saved_tokens_total"] == 0
    assert decoded["vllm:kvflow_role_unsaved_tokens_total"] == 0  # it computed no chunk
    assert prefilled["vllm:kvflow_saved_tokens_total"] == sum(map(stored, PROMPTS))


def check_direct(
    extra: dict[str, Any], consumer: Server, reference: dict[str, list[list[int]]]
) -> None:
    """Asked directly, the consumer computes the prompt and stores none of it."""
    objects = pool_stats(extra["shared"]["socket"])["objects"] if "shared" in extra else None
    assert answers(consumer.url, [DIRECT]) == reference["direct"]
    after = consumer.metrics()
    assert after["vllm:kvflow_saved_tokens_total"] == 0
    assert after["vllm:kvflow_role_unsaved_tokens_total"] == whole_chunks(DIRECT)
    if objects is not None:
        assert pool_stats(extra["shared"]["socket"])["objects"] == objects
