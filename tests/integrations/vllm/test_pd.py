"""Prefill/decode disaggregation in real ``vllm serve``: a ``kv_producer`` and a ``kv_consumer``
instance on one pool (kvflow's shared pool; Mooncake Store), ``examples/pd_proxy.py`` in front.

Every request goes through the proxy, four at a time: to the producer with ``max_tokens`` 1,
then at once (no sleep) to the consumer, whose answer comes back. Checked, per pool: the
consumer's external hits are every whole block of every prompt short of its last token (whole
chunks, then a tail: the producer's save was committed before it answered), its tokens are those
of one instance without a connector, the consumer saved nothing (its own counters) while the
producer saved every whole block of every prompt, and a
prompt sent to the consumer directly (no prefill) is computed there and not stored. With the
shared pool stopped, requests through the proxy still get the single instance's tokens (every
lookup a miss, nothing waits).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.pd import (
    DOWN,
    PROMPTS,
    answers,
    check_direct,
    check_pairing,
    running,
    start,
)
from tests.support.pools import pool_server, require_mooncake
from tests.support.serve import Server, kvflow_mooncake_extra, kvflow_transfer_config
from tests.support.vllm import LOOKUP, POOL_TIMEOUT_S, keep_log


@pytest.fixture
def shared_pool(tmp_path: Path) -> Iterator[dict[str, Any]]:
    socket = f"{tmp_path}/pool.sock"
    with pool_server(socket, "256MiB") as server:
        yield {
            # no auto-start: a stopped pool stays stopped (and nothing outlives the test)
            "extra": {
                "shared": {"socket": socket, "auto_start": False, "timeout_s": POOL_TIMEOUT_S},
                **LOOKUP,
            },
            "stop": server.stop,
        }


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
    pd_reference: dict[str, list[list[int]]],
    tmp_path: Path,
) -> None:
    extra = request.getfixturevalue(pool)["extra"]
    producer = start(
        vllm_python,
        tiny_model,
        tmp_path,
        "producer",
        kv_transfer_config=kvflow_transfer_config(extra, "kv_producer"),
    )
    consumer = start(
        vllm_python,
        tiny_model,
        tmp_path,
        "consumer",
        kv_transfer_config=kvflow_transfer_config(extra, "kv_consumer"),
    )
    with running(producer, consumer):
        proxy = Server.proxy(vllm_python, [producer], [consumer], log=tmp_path / "proxy.log")
        keep_log(proxy.log)
        with running(proxy):
            answered = answers(proxy.url, PROMPTS)
            decoded, prefilled = consumer.metrics(), producer.metrics()
            check_pairing(answered, pd_reference, decoded, prefilled)
            check_direct(extra, consumer, pd_reference)
            stop = request.getfixturevalue(pool)["stop"]
            if stop is not None:
                stop()
                hits = consumer.metrics()["vllm:external_prefix_cache_hits_total"]
                assert answers(proxy.url, [DOWN]) == pd_reference["down"]
                assert consumer.metrics()["vllm:external_prefix_cache_hits_total"] == hits
