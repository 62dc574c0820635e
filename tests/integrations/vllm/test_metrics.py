"""KVFlowConnectorStats and KVFlowPromMetrics against vLLM's own metric classes, in the vLLM
interpreter (``$KVFLOW_VLLM_PYTHON``): a scheduler's and two workers' stats are aggregated as
vLLM aggregates them, cross a process boundary as their ``data`` dict (msgpack, as vLLM ships
them), and land on a Prometheus registry through ``build_prom_metrics``: counters, the layer
wait histogram and the save backlog gauge, per engine."""

from __future__ import annotations

import json
import subprocess
import textwrap

from tests.support.processes import REPO

SCRIPT = textwrap.dedent(
    """
    import json
    from types import SimpleNamespace as NS

    import msgspec
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from kvflow.integrations.vllm import KVFlowConnector
    from kvflow.integrations.vllm.metrics import MAX_SAMPLES, KVFlowConnectorStats

    scheduler = KVFlowConnectorStats()
    scheduler.record_lookup(asked_tokens=256, hit_tokens=192)
    scheduler.record_lookup(asked_tokens=64, hit_tokens=0)
    workers = [KVFlowConnectorStats(), KVFlowConnectorStats()]
    for i, w in enumerate(workers):
        w.data["loads"] += 1
        w.data["loaded_bytes"] += 1000 * (i + 1)
        w.data["saves"] += 1
        w.data["save_failed_chunks"] += i
        w.record_layer_wait(0.002 * (i + 1))
        w.record_layer_wait(0.00002)
        w.record_save_backlog(3 - i)
    empty = KVFlowConnectorStats()
    total = workers[0].aggregate(workers[1]).aggregate(scheduler)
    shipped = msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict()))
    rebuilt = KVFlowConnector.build_kv_connector_stats(shipped)

    capped = KVFlowConnectorStats()
    for _ in range(MAX_SAMPLES + 5):
        capped.record_layer_wait(0.001)

    config = NS(kv_transfer_config=NS())
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    prom = KVFlowConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}
    )
    prom.observe(rebuilt.to_dict(), engine_idx=1)
    prom.observe(rebuilt.to_dict(), engine_idx=1)

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, {"model_name": "m", "engine": "1", **labels})

    print(json.dumps({
        "empty": empty.is_empty(),
        "reduce": rebuilt.reduce(),
        "capped_samples": len(capped.data["layer_wait_samples"]),
        "capped_waits": capped.data["layer_waits"],
        "hits": value("vllm:kvflow_hit_tokens_total"),
        "misses": value("vllm:kvflow_miss_tokens_total"),
        "lookups": value("vllm:kvflow_lookups_total"),
        "loaded_bytes": value("vllm:kvflow_loaded_bytes_total"),
        "save_failed_chunks": value("vllm:kvflow_save_failed_chunks_total"),
        "engine0_hits": REGISTRY.get_sample_value(
            "vllm:kvflow_hit_tokens_total", {"model_name": "m", "engine": "0"}
        ),
        "wait_count": value("vllm:kvflow_layer_wait_seconds_count"),
        "wait_le_1e-4": value("vllm:kvflow_layer_wait_seconds_bucket", le="0.0001"),
        "wait_le_5e-3": value("vllm:kvflow_layer_wait_seconds_bucket", le="0.005"),
        "wait_sum": value("vllm:kvflow_layer_wait_seconds_sum"),
        "backlog": value("vllm:kvflow_save_backlog_layers"),
    }))
    """
)


def test_stats_reach_prometheus_through_vllms_hooks(vllm_python: str) -> None:
    proc = subprocess.run(
        [vllm_python, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["empty"] is True
    reduced = out["reduce"]
    assert reduced["lookups"] == 2 and reduced["hit_tokens"] == 192
    assert reduced["miss_tokens"] == 64 + 64
    assert reduced["loads"] == reduced["saves"] == 2
    assert reduced["save_backlog_max"] == 3  # the largest, not the sum
    assert reduced["layer_waits"] == 4
    assert out["capped_samples"] == 1 << 14 and out["capped_waits"] == (1 << 14) + 5
    # observed twice on engine 1: counters add up, engine 0 untouched
    assert out["hits"] == 2 * 192 and out["misses"] == 2 * 128 and out["lookups"] == 4
    assert out["loaded_bytes"] == 2 * 3000 and out["save_failed_chunks"] == 2
    assert out["engine0_hits"] == 0
    assert out["wait_count"] == 8
    assert out["wait_le_1e-4"] == 4  # the 20 us waits
    assert out["wait_le_5e-3"] == 8
    assert abs(out["wait_sum"] - 2 * (0.002 + 0.004 + 2 * 0.00002)) < 1e-9
    assert out["backlog"] == 3
