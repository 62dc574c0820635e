"""One Mooncake pool across hosts (network namespaces, Mooncake's TCP transport between them):
what one host saved, the others load bit-exact, with the bytes seen on the links; every host's
segment adds to the pool; a batch costs the master the same calls wherever its objects lie."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvflow import ChunkStatus
from kvflow.bench.cluster import Cluster
from kvflow.bench.hostload import LAYERS, OBJECT_BYTES

PROMPTS, CHUNKS = 32, 4  # 128 objects of 128 KiB: 16 MiB


def _touch(path: str) -> None:
    Path(path).touch()


def test_what_one_host_saved_two_others_load_bit_exact(
    cluster_of: Callable[..., Cluster],
) -> None:
    cluster = cluster_of(4)
    prompts = list(range(PROMPTS))
    saver = cluster.worker(
        1, "saver", "saver", segment="64MiB", prompts=prompts, chunks=CHUNKS,
        release=cluster.path("release"),
    )  # fmt: skip
    saved = saver.wait_ready()["status"]
    assert {s for status in saved for s in status} == {ChunkStatus.OK}, saved
    go = cluster.path("go")
    loaders = [
        cluster.worker(h, f"loader{h}", "loader", prompts=prompts, chunks=CHUNKS, go=go)
        for h in (2, 3)
    ]
    for loader in loaders:
        loader.wait_ready()
    before = [h.link_bytes() for h in cluster.net]
    _touch(cluster.path("go"))
    results = [loader.result() for loader in loaders]
    after = [h.link_bytes() for h in cluster.net]
    _touch(cluster.path("release"))
    assert saver.result()["status"] == saved

    payload = PROMPTS * CHUNKS * OBJECT_BYTES
    for result in results:
        assert result["chunks_ok"] == PROMPTS * CHUNKS, result
        assert result["wrong"] == result["missing"] == result["failed"] == 0, result
        assert result["lookups_short"] == 0
        # one get session per batch (start and end) and one ranged copy per layer
        assert result["master_calls_per_batch"] == [2]
        assert result["copy_calls_per_batch"] == [LAYERS]
    received = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    sent = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    # the bytes crossed the links: out of host 1 once per reader, into each reader once
    assert sent[1] >= 2 * payload
    assert received[2] >= payload and received[3] >= payload
    assert sent[2] < payload // 8 and sent[3] < payload // 8  # requests and acks only
    assert received[0] + sent[0] < payload // 8  # the master carries metadata, not KV


def test_every_hosts_segment_adds_to_the_pool(cluster_of: Callable[..., Cluster]) -> None:
    """Three hosts give 24 MiB each; a pure client on a fourth saves 48 MiB, which no one
    segment could hold: all of it is stored and loads bit-exact, from every segment, at the
    master calls a batch costs when its objects lie on one host."""
    cluster = cluster_of(5)
    holders = [
        cluster.worker(h, f"holder{h}", "holder", segment="24MiB", release=cluster.path("end"))
        for h in (1, 2, 3)
    ]
    for holder in holders:
        holder.wait_ready()
    prompts = list(range(96))  # 384 objects of 128 KiB
    before = [h.link_bytes() for h in cluster.net]
    saver = cluster.worker(4, "saver", "saver", prompts=prompts, chunks=CHUNKS)
    statuses = saver.result()["status"]
    assert {s for status in statuses for s in status} == {ChunkStatus.OK}
    into = [a[0] - b[0] for a, b in zip((h.link_bytes() for h in cluster.net), before, strict=True)]
    total = len(prompts) * CHUNKS * OBJECT_BYTES
    assert total > 24 << 20
    assert sum(into[1:4]) >= total
    for h in (1, 2, 3):  # every segment took a share
        assert into[h] >= 4 << 20, into

    loader = cluster.worker(4, "loader", "loader", prompts=prompts, chunks=CHUNKS)
    result = loader.result()
    assert result["chunks_ok"] == len(prompts) * CHUNKS, result
    assert result["wrong"] == result["missing"] == result["failed"] == 0
    assert result["master_calls_per_batch"] == [2]
    assert result["copy_calls_per_batch"] == [LAYERS]
    _touch(cluster.path("end"))
    for holder in holders:
        assert holder.result()["released"]
