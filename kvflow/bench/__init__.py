"""``kvflow bench``: every scenario measured against a reference taken in the same run.

A scenario is a module with ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args, report) -> dict`` (the JSON document); it may have ``plot(result, path)``. The
registry maps names to modules, imported only when chosen.
"""

from __future__ import annotations

SCENARIOS: dict[str, str] = {
    "ttft": "kvflow.bench.ttft",
    "copy": "kvflow.bench.copy",
    "addrgen": "kvflow.bench.addrgen",
    "metadata": "kvflow.bench.metadata",
    "overhead": "kvflow.bench.overhead",
    "pool": "kvflow.bench.pool",
    "mooncake": "kvflow.bench.mooncake",
    "disk": "kvflow.bench.disk",
    "hosts": "kvflow.bench.hosts",
}

__all__ = ["SCENARIOS"]
