"""A herd on one prefix in real ``vllm serve`` (``tests/support/herd.py``): a prefix one
instance computed (kvflow's shared pool keeps it), then ``SIZE`` requests sharing it, each with
its own suffix, all at once on a second instance whose device never held it, ``/metrics``
scraped every 100 ms.

Checked: every answer has the tokens of an instance without a connector; the connector gave
vLLM the prefix once for the whole herd (vLLM's prefix cache served the other requests from
the blocks that one load filled), not once per request; what kvflow counted loading is what
vLLM counted as external hits, with no failed load; every scrape answered, no counter went down;
the pool is left with no lease, open session or pending write.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.herd import herd, seed
from tests.support.pd import running, start
from tests.support.pools import pool_server
from tests.support.serve import kvflow_transfer_config, pool_stats
from tests.support.vllm import POOL_TIMEOUT_S

PREFIX = 768  # 12 chunks; the instances' device KV (64 blocks of 32) holds it and the herd
SIZE = 8


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[str]:
    with pool_server(f"{tmp_path}/pool.sock", "256MiB"):
        yield f"{tmp_path}/pool.sock"


def test_a_herd_on_a_pooled_prefix_loads_it_once(
    vllm_python: str, tiny_model: str, pool: str, tmp_path: Path
) -> None:
    config = kvflow_transfer_config(
        {"shared": {"socket": pool, "auto_start": False, "timeout_s": POOL_TIMEOUT_S}}
    )
    seeder, herder, reference = (
        start(vllm_python, tiny_model, tmp_path, name, max_num_seqs=SIZE, kv_transfer_config=c)
        for name, c in (("seed", config), ("herd", config), ("reference", None))
    )
    with running(seeder, herder, reference):
        seed(seeder, 0, PREFIX)
        got = herd(herder, 0, SIZE, PREFIX)
        expected = herd(reference, 0, SIZE, PREFIX)
    assert [a.tokens for a in got.answers] == [a.tokens for a in expected.answers]
    assert got.counted["external_hit_tokens"] == PREFIX, got.counted  # one copy, whole
    assert got.counted["loaded_tokens"] == got.counted["external_hit_tokens"]
    assert got.counted["load_failed_tokens"] == 0
    assert got.counted["device_hit_tokens"] >= (SIZE - 1) * PREFIX  # the rest: vLLM's cache
    assert got.scrapes > 0 and not got.scrape_errors and not got.scrape_problems
    stats = pool_stats(pool)
    assert (stats["leases"], stats["open_sessions"], stats["pending_writes"]) == (0, 0, 0)
