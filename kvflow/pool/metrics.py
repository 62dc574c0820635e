"""The pool server's counters in Prometheus' text format: ``kvflow serve --metrics-port PORT``.

Every field of ``kvflow pool stats`` (``protocol.STATS_FIELDS``) is one metric, read from the
server when Prometheus scrapes (nothing is kept between scrapes). Names follow Prometheus'
conventions: counters end in ``_total``, sizes are ``_bytes``, times ``_seconds``; ``METRICS``
lists them with their meaning (docs/shared-pool.md has the same table).

Needs the optional package ``prometheus_client`` (``pip install kvflow[metrics]``); this module
imports it only when an endpoint starts. The endpoint is a plain HTTP server on a daemon thread
of its own; a scrape takes the server's index lock for microseconds, as ``pool stats`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from kvflow.errors import ConfigError, MissingDependencyError

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["DEFAULT_METRICS_HOST", "METRICS", "Metric", "MetricsEndpoint", "require_client"]

DEFAULT_METRICS_HOST = "127.0.0.1"


class Metric(NamedTuple):
    stat: str  # the field of `kvflow pool stats`
    name: str  # the Prometheus family name (a counter's samples add `_total`)
    kind: str  # "counter" or "gauge"
    help: str
    scale: float = 1.0  # the stat times this is the metric's value


METRICS = (
    Metric("capacity", "kvflow_pool_capacity_bytes", "gauge", "Size of the pool's arena."),
    Metric("used", "kvflow_pool_used_bytes", "gauge", "Arena bytes held by objects and writes."),
    Metric("objects", "kvflow_pool_objects", "gauge", "Committed objects (chunks) in the pool."),
    Metric("pending_writes", "kvflow_pool_pending_writes", "gauge", "Objects being written."),
    Metric("leases", "kvflow_pool_leases", "gauge", "Read leases held on objects."),
    Metric("open_sessions", "kvflow_pool_open_sessions", "gauge", "Open read/write sessions."),
    Metric("hits", "kvflow_pool_hits", "counter", "Objects found by lookups and reads."),
    Metric("misses", "kvflow_pool_misses", "counter", "Objects asked for and not found."),
    Metric("evictions", "kvflow_pool_evictions", "counter", "Objects evicted to make room."),
    Metric("no_space", "kvflow_pool_no_space", "counter", "Writes refused for lack of room."),
    Metric("expired_leases", "kvflow_pool_expired_leases", "counter", "Leases past the limit."),
    Metric("clients", "kvflow_pool_clients", "gauge", "Connections served now."),
    Metric("clients_total", "kvflow_pool_connections", "counter", "Connections accepted."),
    Metric(
        "released_on_disconnect",
        "kvflow_pool_released_on_disconnect",
        "counter",
        "Sessions released because their connection ended.",
    ),
    Metric("refused_peers", "kvflow_pool_refused_peers", "counter", "Connections of other uids."),
    Metric("bad_messages", "kvflow_pool_bad_messages", "counter", "Malformed messages."),
    Metric("requests", "kvflow_pool_requests", "counter", "Requests served."),
    Metric(
        "refused_limit",
        "kvflow_pool_refused_connections",
        "counter",
        "Connections refused at the connection limit.",
    ),
    Metric("idle_closed", "kvflow_pool_idle_closed", "counter", "Idle connections closed."),
    Metric("max_clients", "kvflow_pool_max_clients", "gauge", "The connection limit."),
    Metric(
        "idle_timeout_ms",
        "kvflow_pool_idle_timeout_seconds",
        "gauge",
        "Idle connections are closed after this long.",
        1e-3,
    ),
    Metric("disk_capacity", "kvflow_pool_disk_capacity_bytes", "gauge", "The disk tier's size."),
    Metric("disk_used", "kvflow_pool_disk_used_bytes", "gauge", "Bytes of the disk tier's files."),
    Metric("disk_objects", "kvflow_pool_disk_objects", "gauge", "Objects in the disk tier."),
    Metric("disk_hits", "kvflow_pool_disk_hits", "counter", "Lookups found on disk only."),
    Metric(
        "disk_reads_served",
        "kvflow_pool_disk_reads_served",
        "counter",
        "Objects clients read from the disk tier's files.",
    ),
    Metric("demotions", "kvflow_pool_demotions", "counter", "Objects copied down to disk."),
    Metric("demotion_bytes", "kvflow_pool_demoted_bytes", "counter", "Bytes copied down to disk."),
    Metric(
        "demotions_skipped",
        "kvflow_pool_demotions_skipped",
        "counter",
        "Commits not copied to disk (queue full, or evicted before their turn).",
    ),
    Metric("promotions", "kvflow_pool_promotions", "counter", "Objects copied up into DRAM."),
    Metric(
        "promotion_bytes", "kvflow_pool_promoted_bytes", "counter", "Bytes copied up into DRAM."
    ),
    Metric(
        "promotions_failed",
        "kvflow_pool_promotions_failed",
        "counter",
        "Promotions that found no room or a bad file.",
    ),
    Metric("disk_evictions", "kvflow_pool_disk_evictions", "counter", "Objects evicted from disk."),
    Metric("disk_io_errors", "kvflow_pool_disk_io_errors", "counter", "Disk I/O errors."),
    Metric("disk_no_space", "kvflow_pool_disk_no_space", "counter", "Disk writes that hit ENOSPC."),
    Metric(
        "disk_corrupt",
        "kvflow_pool_disk_corrupt",
        "counter",
        "Disk objects dropped: a checksum failed, a file was short or gone.",
    ),
    Metric("disk_recovered", "kvflow_pool_disk_recovered", "gauge", "Disk objects found at start."),
    Metric(
        "disk_dropped_by_clients",
        "kvflow_pool_disk_dropped_by_clients",
        "counter",
        "Disk objects deleted after a client found them bad.",
    ),
    Metric(
        "disk_queued",
        "kvflow_pool_disk_queued",
        "gauge",
        "Objects waiting to be copied to or from disk, or being copied.",
    ),
)


def require_client() -> None:
    """MissingDependencyError unless ``prometheus_client`` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            "kvflow serve --metrics-port", "'kvflow[metrics]' (prometheus_client)"
        ) from exc


class _PoolCollector:
    """Reads ``stats()`` at each scrape and turns it into METRICS."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self._stats()
        for m in METRICS:
            if m.stat not in values:
                continue
            family = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
            yield family(m.name, m.help, value=values[m.stat] * m.scale)


class MetricsEndpoint:
    """``http://host:port/metrics`` serving ``stats()`` (a PoolServer's ``stats``). ``start()``
    binds (ConfigError naming ``--metrics-port`` when the address cannot be had) and returns;
    ``stop()`` closes it. ``port`` 0 takes a free port, then ``port`` tells which."""

    def __init__(
        self, stats: Callable[[], dict[str, int]], port: int, host: str = DEFAULT_METRICS_HOST
    ) -> None:
        require_client()
        from prometheus_client import CollectorRegistry

        self.host = host
        self.port = port
        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.registry.register(_PoolCollector(stats))
        self._server: Any = None
        self._thread: Any = None

    def start(self) -> None:
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(
                self.port, addr=self.host, registry=self.registry
            )
        except OSError as exc:
            where = f"{self.host}:{self.port}"
            raise ConfigError(
                "--metrics-port", self.port, f"cannot serve on {where}: {exc}"
            ) from exc
        self.port = int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5.0)
            self._server = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"
