"""Prefill/decode disaggregation in real ``vllm serve``: a ``kv_producer`` and a ``kv_consumer``
instance on one pool (kvflow's shared pool; Mooncake Store), ``examples/pd_proxy.py`` in front.

Every request goes through the proxy, four at a time: to the producer with ``max_tokens`` 1,
then at once (no sleep) to the consumer, whose answer comes back. Checked, per pool: the
consumer's external hits are every whole chunk of every prompt (the producer's save was
committed before it answered), its tokens are those of one instance without a connector, the
consumer saved nothing (its own counters) while the producer saved every prompt chunk, and a
prompt sent to the consumer directly (no prefill) is computed there and not stored. With the
shared pool stopped, requests through the proxy still get the single instance's tokens (every
lookup a miss, nothing waits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvflow.pool import PoolConfig, PoolServer
from tests.support.pools import require_mooncake
from tests.support.processes import REPO
from tests.support.serve import (
    Server,
    kvflow_mooncake_extra,
    kvflow_transfer_config,
    pool_stats,
    serve_args,
    stream_completion,
)
from tests.support.vllm import keep_log

BLOCK = 32
CHUNK_TOKENS = 64  # the connector's default: 2 blocks of 32
MAX_TOKENS = 12
CONCURRENCY = 4
ARGS = {"block_size": BLOCK, "num_blocks": 64, "max_model_len": 1024}  # device KV: 2048 tokens


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1024, n)]


PROMPTS = [_tokens(200 + 37 * i, 500 + i) for i in range(8)]  # 200..459 tokens
DIRECT = _tokens(330, 599)  # sent to the consumer without a prefill
DOWN = _tokens(280, 598)  # sent through the proxy with the shared pool stopped


def _chunked(prompt: list[int]) -> int:
    """The tokens of a prompt's whole chunks, short of its last token (what a hit can be)."""
    return (len(prompt) - 1) // CHUNK_TOKENS * CHUNK_TOKENS


def _stored(prompt: list[int]) -> int:
    """The tokens of a prompt's whole chunks (what its prefill saves)."""
    return len(prompt) // CHUNK_TOKENS * CHUNK_TOKENS


def _answers(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as threads:
        results = threads.map(lambda p: stream_completion(url, p, max_tokens=MAX_TOKENS), prompts)
        return [r["tokens"] for r in results]


def _start(python: str, model: str, tmp: Path, name: str, **more: Any) -> Server:
    log = tmp / f"{name}.log"
    keep_log(log)
    args = [*serve_args(**ARGS, **more), "--dtype", "float32"]  # tokens exact across paths
    return Server(python, model, args, log=log, cwd=str(REPO))


@contextlib.contextmanager
def _running(*servers: Server) -> Iterator[None]:
    """Wait for servers started together; stop them all however the test ends."""
    try:
        for server in servers:
            server.ready()
        yield
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def reference(
    vllm_python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[list[int]]]:
    """The greedy tokens of one instance without a connector, asked as the P/D pair is."""
    tmp = tmp_path_factory.mktemp("pd-reference")
    server = _start(vllm_python, tiny_model, tmp, "reference")
    with _running(server):
        return {
            "prompts": _answers(server.url, PROMPTS),
            "direct": _answers(server.url, [DIRECT]),
            "down": _answers(server.url, [DOWN]),
        }


@pytest.fixture
def shared_pool(tmp_path: Path) -> Iterator[dict[str, Any]]:
    socket = f"{tmp_path}/pool.sock"
    server = PoolServer(PoolConfig(socket=socket, capacity="256MiB"))
    server.start()
    try:
        yield {
            # no auto-start: a stopped pool stays stopped (and nothing outlives the test)
            "extra": {"shared": {"socket": socket, "auto_start": False}, "lookup_timeout_s": 30.0},
            "stop": server.stop,
        }
    finally:
        server.stop()


@pytest.fixture
def mooncake_pool() -> Iterator[dict[str, Any]]:
    require_mooncake()
    from kvflow.stores.mooncake.master import MooncakeMaster

    with MooncakeMaster() as master:
        extra = kvflow_mooncake_extra(master.address, "128MiB")
        yield {"extra": {**extra, "lookup_timeout_s": 30.0}, "stop": None}


@pytest.mark.parametrize("pool", ["shared_pool", "mooncake_pool"])
def test_decode_hits_every_chunk_the_moment_prefill_answered(
    pool: str,
    request: pytest.FixtureRequest,
    vllm_python: str,
    tiny_model: str,
    reference: dict[str, list[list[int]]],
    tmp_path: Path,
) -> None:
    extra = request.getfixturevalue(pool)["extra"]
    producer = _start(
        vllm_python,
        tiny_model,
        tmp_path,
        "producer",
        kv_transfer_config=kvflow_transfer_config(extra, "kv_producer"),
    )
    consumer = _start(
        vllm_python,
        tiny_model,
        tmp_path,
        "consumer",
        kv_transfer_config=kvflow_transfer_config(extra, "kv_consumer"),
    )
    with _running(producer, consumer):
        proxy = Server.proxy(vllm_python, [producer], [consumer], log=tmp_path / "proxy.log")
        keep_log(proxy.log)
        with _running(proxy):
            answers = _answers(proxy.url, PROMPTS)
            decoded, prefilled = consumer.metrics(), producer.metrics()
            check_pairing(extra, answers, reference, decoded, prefilled)
            check_direct(extra, consumer, reference)
            stop = request.getfixturevalue(pool)["stop"]
            if stop is not None:
                stop()
                hits = consumer.metrics()["vllm:external_prefix_cache_hits_total"]
                assert _answers(proxy.url, [DOWN]) == reference["down"]
                assert consumer.metrics()["vllm:external_prefix_cache_hits_total"] == hits


def check_pairing(
    extra: dict[str, Any],
    answers: list[list[int]],
    reference: dict[str, list[list[int]]],
    decoded: dict[str, float],
    prefilled: dict[str, float],
) -> None:

    assert answers == reference["prompts"]
    prompt_tokens = sum(len(p) for p in PROMPTS)
    assert decoded["vllm:prompt_tokens_total"] == prompt_tokens
    assert decoded["vllm:external_prefix_cache_hits_total"] == sum(map(_chunked, PROMPTS))
    assert decoded["vllm:kvflow_load_failed_tokens_total"] == 0
    assert decoded["vllm:kvflow_saved_tokens_total"] == 0
    assert decoded["vllm:kvflow_role_unsaved_tokens_total"] == 0  # it computed no chunk
    assert prefilled["vllm:kvflow_saved_tokens_total"] == sum(map(_stored, PROMPTS))


def check_direct(
    extra: dict[str, Any], consumer: Server, reference: dict[str, list[list[int]]]
) -> None:
    """Asked directly, the consumer computes the prompt and stores none of it."""
    objects = pool_stats(extra["shared"]["socket"])["objects"] if "shared" in extra else None
    assert _answers(consumer.url, [DIRECT]) == reference["direct"]
    after = consumer.metrics()
    assert after["vllm:kvflow_saved_tokens_total"] == 0
    assert after["vllm:kvflow_role_unsaved_tokens_total"] == _stored(DIRECT)
    if objects is not None:
        assert pool_stats(extra["shared"]["socket"])["objects"] == objects
