"""The connector's counters on vLLM's own metrics: its log line and its Prometheus ``/metrics``.

Both of vLLM's roles count into a ``KVFlowConnectorStats``: the scheduler its lookups (hits and
misses, in tokens), each worker what it moved (tokens, bytes, failed chunks), how long the model
thread waited for each layer's load, and how many layers of a step's save were still to copy
when the step ended. vLLM drains them every step (``get_kv_connector_stats``), sums the
workers' and the scheduler's (``aggregate``), ships the ``data`` dict to the front end, logs
``reduce()`` and hands the dict to ``KVFlowPromMetrics.observe``, which vLLM builds through the
connector's ``build_prom_metrics``. The names are vLLM's style (``vllm:kvflow_...``, with vLLM's
``model_name`` and ``engine`` labels); docs/vllm.md lists them.

Concurrency: each role fills its stats under the lock of its ``StatsInterval``, which vLLM's
``get_kv_connector_stats`` takes it from; vLLM calls ``aggregate``, ``reduce`` and ``observe``
from one thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "COUNTERS",
    "LAYER_WAIT_BUCKETS",
    "KVFlowConnectorStats",
    "KVFlowPromMetrics",
    "StatsInterval",
]

# summed counters: (stats field, Prometheus name without _total, help)
COUNTERS = (
    ("lookups", "vllm:kvflow_lookups", "Scheduler lookups of a request's chunks in the pool."),
    ("lookup_errors", "vllm:kvflow_lookup_errors", "Lookups that failed (counted as misses)."),
    ("hit_tokens", "vllm:kvflow_hit_tokens", "Prompt tokens the pool can provide (lookups)."),
    ("miss_tokens", "vllm:kvflow_miss_tokens", "Prompt tokens looked up and not provided."),
    ("loads", "vllm:kvflow_loads", "Steps of a worker with a load."),
    ("loaded_tokens", "vllm:kvflow_loaded_tokens", "Tokens loaded from the pool."),
    ("loaded_bytes", "vllm:kvflow_loaded_bytes", "KV bytes loaded from the pool."),
    ("load_failed_tokens", "vllm:kvflow_load_failed_tokens", "Tokens whose load failed."),
    ("load_failed_chunks", "vllm:kvflow_load_failed_chunks", "Chunks whose load failed."),
    ("saves", "vllm:kvflow_saves", "Steps of a worker with a save."),
    ("saved_tokens", "vllm:kvflow_saved_tokens", "Tokens saved to the pool."),
    ("saved_bytes", "vllm:kvflow_saved_bytes", "KV bytes saved to the pool."),
    (
        "save_skipped_tokens",
        "vllm:kvflow_save_skipped_tokens",
        "Tokens not saved: in the pool already, or no room.",
    ),
    ("save_failed_tokens", "vllm:kvflow_save_failed_tokens", "Tokens whose save failed."),
    ("save_failed_chunks", "vllm:kvflow_save_failed_chunks", "Chunks whose save failed."),
    (
        "role_unsaved_tokens",
        "vllm:kvflow_role_unsaved_tokens",
        "Prompt tokens computed and not saved: a kv_consumer saves nothing.",
    ),
    ("layer_waits", "vllm:kvflow_layer_waits", "Waits of the model thread for a layer's load."),
    ("layer_wait_s", "vllm:kvflow_layer_wait_seconds_sum", "Seconds of those waits."),
)
_MAXIMA = ("layer_wait_max_s", "save_backlog_max")  # the largest of the interval
_SAMPLES = "layer_wait_samples"  # each wait, seconds, for the histogram
MAX_SAMPLES = 1 << 14  # per interval: beyond, waits count in the sums but not the histogram
LAYER_WAIT_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@dataclass
class KVFlowConnectorStats(KVConnectorStats):
    """The connector's counters for one interval, summed over the scheduler, the workers and
    the steps. ``data`` holds plain numbers and one list (it crosses processes)."""

    data: dict[str, Any] = field(default_factory=dict)
    FIELDS = (*(c[0] for c in COUNTERS), *_MAXIMA)

    def __post_init__(self) -> None:
        for name in self.FIELDS:
            self.data.setdefault(name, 0)
        self.data.setdefault(_SAMPLES, [])

    def reset(self) -> None:
        self.data = dict.fromkeys(self.FIELDS, 0)
        self.data[_SAMPLES] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in self.FIELDS:
            value = other.data.get(name, 0)
            if name in _MAXIMA:
                self.data[name] = max(self.data[name], value)
            else:
                self.data[name] += value
        self._add_samples(other.data.get(_SAMPLES, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in self.FIELDS}
        waits = self.data["layer_waits"]
        out["layer_wait_mean_ms"] = 1e3 * self.data["layer_wait_s"] / waits if waits else 0.0
        return out

    def is_empty(self) -> bool:
        counted = ("loads", "saves", "lookups", "role_unsaved_tokens")
        return not any(self.data[name] for name in counted)

    # -- recording (the connector's calls, in its StatsInterval's update) --------------------

    def record_lookup(self, asked_tokens: int, hit_tokens: int) -> None:
        self.data["lookups"] += 1
        self.data["hit_tokens"] += hit_tokens
        self.data["miss_tokens"] += max(0, asked_tokens - hit_tokens)

    def record_layer_wait(self, seconds: float) -> None:
        d = self.data
        d["layer_waits"] += 1
        d["layer_wait_s"] += seconds
        d["layer_wait_max_s"] = max(d["layer_wait_max_s"], seconds)
        self._add_samples((seconds,))

    def record_save_backlog(self, layers: int) -> None:
        self.data["save_backlog_max"] = max(self.data["save_backlog_max"], layers)

    def _add_samples(self, samples: Any) -> None:
        kept: list[float] = self.data[_SAMPLES]
        room = MAX_SAMPLES - len(kept)
        if room > 0:
            kept.extend(list(samples)[:room])


class StatsInterval:
    """One role's ``KVFlowConnectorStats`` since vLLM last took them: filled in ``update()``
    blocks, under a lock, and handed over (and replaced) by ``take()``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVFlowConnectorStats()

    @contextmanager
    def update(self) -> Iterator[KVFlowConnectorStats]:
        with self._lock:
            yield self._stats

    def take(self) -> KVFlowConnectorStats | None:
        """The interval's stats, None when nothing was counted; a new interval begins."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVFlowConnectorStats()
        return out


class KVFlowPromMetrics(KVConnectorPromMetrics):
    """``KVFlowConnectorStats`` on vLLM's Prometheus registry, per engine: every counter of
    ``COUNTERS`` (``_total``), ``vllm:kvflow_layer_wait_seconds`` (a histogram of the model
    thread's waits for a layer's load) and ``vllm:kvflow_save_backlog_layers`` (a gauge: the
    most layers of a save still to copy when a step ended, in the last interval reported)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for stat, name, doc in COUNTERS:
            if stat == "layer_wait_s":  # the histogram's _sum already
                continue
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[stat] = create_metric_per_engine(metric, per_engine_labelvalues)
        waits = self._histogram_cls(
            name="vllm:kvflow_layer_wait_seconds",
            documentation="Time the model thread waited for one layer's load.",
            buckets=list(LAYER_WAIT_BUCKETS),
            labelnames=labelnames,
        )
        self._waits = create_metric_per_engine(waits, per_engine_labelvalues)
        backlog = self._gauge_cls(
            name="vllm:kvflow_save_backlog_layers",
            documentation="Most layers of a step's save still to copy when the step ended.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._backlog = create_metric_per_engine(backlog, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for stat, per_engine in self._counters.items():
            value = data.get(stat, 0)
            if value:
                per_engine[engine_idx].inc(value)
        waits = self._waits[engine_idx]
        for seconds in data.get(_SAMPLES, ()):
            waits.observe(seconds)
        if data.get("saves"):
            self._backlog[engine_idx].set(data.get("save_backlog_max", 0))
