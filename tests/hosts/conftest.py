"""Fixtures for the multi-host tests: hosts are network namespaces on this machine (root only;
``tests.support.hosts``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvflow.bench.cluster import Cluster
from tests.support.hosts import require_hosts
from tests.support.pools import require_mooncake


@pytest.fixture
def cluster_of(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """``cluster_of(n, *master_flags)``: a Mooncake pool over ``n`` hosts (the master on host
    0); every process, namespace and link it made is removed when the test ends."""
    require_hosts()
    require_mooncake()
    made: list[Cluster] = []

    def make(hosts: int, *flags: str) -> Cluster:
        cluster = Cluster(hosts, str(tmp_path), *flags, prefix=f"{tmp_path.name}/")
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
