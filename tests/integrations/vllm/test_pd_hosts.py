"""Prefill on one host, decode on another, one Mooncake pool between them: real ``vllm serve``
instances on network-namespace hosts (``kvflow.testing.netns``), ``mooncake_master`` on a third,
Mooncake's TCP transport across the bridge, ``examples/pd_proxy.py`` in this process's own
namespace (the network's uplink).

The producer gives the pool its segment; the consumer gives none (a pure client), so every
chunk it loads crosses the link from the producer's host: counted there, and on the master's
link only metadata. Checked as on one machine (``tests/support/pd.py``): the consumer hits every
whole chunk of every prompt the moment the producer answered, and its tokens are those of one
instance without a connector.
"""

from __future__ import annotations

from pathlib import Path

from kvflow.bench.cluster import Cluster
from kvflow.testing.netns import Host
from tests.support.hosts import require_hosts
from tests.support.pd import PROMPTS, answers, check_pairing, chunked, running, start
from tests.support.pools import require_mooncake
from tests.support.serve import Server, kvflow_mooncake_extra, kvflow_transfer_config
from tests.support.vllm import keep_log

KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # the tiny model: layers x (K, V) x heads x dims x fp32


def _on(cluster: Cluster, host: Host, segment: str, role: str) -> dict[str, object]:
    """What starts an instance on ``host``: its address, the command prefix, the connector
    registering ``host``'s own address with the pool."""
    extra = kvflow_mooncake_extra(cluster.master_address, segment, local_hostname=host.address)
    return {
        "kv_transfer_config": kvflow_transfer_config({**extra, "lookup_timeout_s": 30.0}, role),
        "host": host.address,
        "prefix": host.command([]),
        "env": {"VLLM_HOST_IP": host.address},
    }


def test_prefill_on_one_host_decode_on_another(
    vllm_python: str,
    tiny_model: str,
    pd_reference: dict[str, list[list[int]]],
    tmp_path: Path,
) -> None:
    require_hosts()
    require_mooncake()
    with Cluster(3, str(tmp_path), prefix="pd/", uplink=True) as cluster:
        master, prefill, decode = cluster.net
        producer = start(
            vllm_python, tiny_model, tmp_path, "producer",
            **_on(cluster, prefill, "128MiB", "kv_producer"),
        )  # fmt: skip
        consumer = start(
            vllm_python, tiny_model, tmp_path, "consumer",
            **_on(cluster, decode, "0", "kv_consumer"),
        )  # fmt: skip
        with running(producer, consumer):
            proxy = Server.proxy(vllm_python, [producer], [consumer], log=tmp_path / "proxy.log")
            keep_log(proxy.log)
            with running(proxy):
                before = [h.link_bytes() for h in cluster.net]
                answered = answers(proxy.url, PROMPTS)
                after = [h.link_bytes() for h in cluster.net]
                check_pairing(answered, pd_reference, consumer.metrics(), producer.metrics())

    loaded = sum(map(chunked, PROMPTS)) * KV_BYTES_PER_TOKEN
    received = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    sent = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sent[1] >= loaded, (sent, loaded)  # out of the producer's segment ...
    assert received[2] >= loaded, (received, loaded)  # ... into the consumer
    assert received[0] + sent[0] < loaded // 8  # the master carries metadata, not KV
