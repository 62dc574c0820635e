"""Hosts for the multi-host tests: network namespaces on this machine (``kvflow.testing.netns``),
which need root; elsewhere those tests skip naming why (in CI, which runs as root, they fail)."""

from __future__ import annotations

from kvflow.testing import netns
from tests.support.pools import unavailable


def require_hosts() -> None:
    reason = netns.unavailable()
    if reason is not None:
        unavailable(f"multi-host tests: {reason}")
