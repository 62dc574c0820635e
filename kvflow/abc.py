"""The interfaces kvflow is extended through: a pool engine (``Store``), a device (``DeviceOps``).

Users of the engine need none of this (``import kvflow`` has what they need); it is for those who
write a store or order transfers on a device kvflow does not know.

A store subclasses ``Store``; its contract (two metadata calls per request batch, address-only
copies per layer, what is visible when, thread safety) is in ``kvflow.stores.base``'s docstring
and each method's. ``open_write`` hands out a ``WriteSession`` (per-key ``WriteStatus`` and base
addresses), ``open_read`` a ``ReadSession``; ``batch_copy`` moves bytes in a ``Direction``.
Optional abilities are ``Store`` methods with defaults: the ``*_with_context`` calls (eviction
ordered by prefix; by default the plain calls), ``usage()`` (occupancy and counters; by
default None), ``contents_epoch()`` (changes when a restarted pool lost what it held; by
default None) and ``prepare_writes()`` (a save's copies checked once for all its layers, a
``PreparedWrites``; by default None). A store that forwards to another (to count, to inject
faults, to share it) subclasses ``StoreWrapper``, which forwards every call, abilities included
but ``prepare_writes``, and overrides only what it changes. ``SupportsUsage`` and
``SupportsPrefixContext``, the protocols of earlier releases, still import, with a
DeprecationWarning.

A device subclasses ``DeviceOps`` (readiness tokens: when a layer's bytes may move, and how the
caller's compute is ordered after a load), or ``StreamDevice`` for an accelerator that torch's
device-generic stream and event API serves; pass it as ``TransferEngine(..., device=...)``.
"""

from __future__ import annotations

from kvflow.devices import DeviceOps, StreamDevice
from kvflow.stores.base import (
    Direction,
    PreparedWrites,
    ReadSession,
    Store,
    StoreUsage,
    WriteSession,
    WriteStatus,
    deprecated_name,
)
from kvflow.stores.wrapper import StoreWrapper

__all__ = [
    "DeviceOps",
    "Direction",
    "PreparedWrites",
    "ReadSession",
    "Store",
    "StoreUsage",
    "StoreWrapper",
    "StreamDevice",
    "WriteSession",
    "WriteStatus",
]


def __getattr__(name: str) -> type:
    return deprecated_name(__name__, name)
