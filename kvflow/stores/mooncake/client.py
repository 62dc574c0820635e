"""Mooncake's client at the boundary: its codes (and what they mean to kvflow), its import and
setup, and local reads: finding this process's own segment and where a replica lies.

Local reads: Mooncake's ranged calls go through its transfer engine even when the object lies
in this process's own segment (the usual case on one node: ``prefer_local_segment``). So a
store with ``local_reads`` learns once, at setup, which transfer endpoint is its own
(``own_endpoint``: a probe object put into the own segment, its bytes read back at the address
the master reports), and then copies a read session's ranges of objects whose complete replica
lies there (``in_segment``) straight from it, under the master's lease.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvflow.errors import MissingDependencyError, StoreError, StoreUnavailableError
from kvflow.stores.base import WriteStatus
from kvflow.stores.mooncake.config import MooncakeConfig

__all__ = [
    "EXISTS",
    "HAS_LEASE",
    "NOT_FOUND",
    "NOT_READY",
    "NO_SPACE",
    "OK",
    "RPC_FAIL",
    "SESSION_CALLS",
    "in_segment",
    "mooncake_module",
    "own_endpoint",
    "setup",
    "write_status",
]

log = logging.getLogger("kvflow")

OK = 0
NO_SPACE = -200  # NO_AVAILABLE_HANDLE
NOT_READY = -703  # REPLICA_IS_NOT_READY: still being written
NOT_FOUND = -704  # OBJECT_NOT_FOUND
EXISTS = -705  # OBJECT_ALREADY_EXISTS
HAS_LEASE = -706  # OBJECT_HAS_LEASE
RPC_FAIL = -900
SESSION_CALLS = (
    "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
)


def mooncake_module() -> Any:
    """``mooncake.store``, imported now (never when kvflow is)."""
    try:
        import mooncake.store as module
    except ImportError as exc:
        raise MissingDependencyError("MooncakeStore", "'kvflow[mooncake]'") from exc
    return module


def setup(client: Any, config: MooncakeConfig, call: Callable[..., Any]) -> None:
    """The client's ``setup`` for ``config``, through the store's bounded ``call(name, fn,
    *args)``; StoreUnavailableError when Mooncake refuses."""
    rc = call(
        "setup",
        client.setup,
        config.local_hostname,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.device_name,
        config.master_server_address,
    )
    if rc != OK:
        where = config.master_server_address
        raise StoreUnavailableError(f"Mooncake setup with master {where} failed", rc)


def write_status(codes: np.ndarray) -> np.ndarray:
    """``batch_put_session_start``'s codes as WriteStatus: OK is granted, EXISTS and NO_SPACE
    are themselves, anything else failed."""
    status = np.full(len(codes), WriteStatus.FAILED, dtype=np.int8)
    status[codes == OK] = WriteStatus.GRANTED
    status[codes == EXISTS] = WriteStatus.EXISTS
    status[codes == NO_SPACE] = WriteStatus.NO_SPACE
    return status


def own_endpoint(client: Any, config: MooncakeConfig, call: Callable[..., Any]) -> str:
    """The transfer endpoint of this process's own segment ("" when local reads are off,
    there is no own segment, or it cannot be told). A probe object is put with the own
    segment preferred; the endpoint of its replica is the own one only if its address lies
    in readable memory of this process and holds the probe's random bytes there. ``call``:
    the store's bounded ``call(name, fn, *args)``."""
    if not config.local_reads or int(config.global_segment_size) == 0:
        return ""
    if not hasattr(client, "batch_get_replica_desc"):
        return ""
    probe = os.urandom(4096)
    key = f"{config.key_prefix}kvflow-probe/{probe[:8].hex()}"
    replicate = mooncake_module().ReplicateConfig()
    replicate.replica_num = 1
    replicate.preferred_segment = client.get_hostname()
    try:
        if call("put", client.put, key, probe, replicate) != OK:
            return ""
        try:
            replicas = call("batch_get_replica_desc", client.batch_get_replica_desc, [key])
        finally:
            call("batch_remove", client.batch_remove, [key], True)
    except StoreError as exc:
        log.debug("kvflow: Mooncake local reads off: %s", exc)
        return ""
    for replica in replicas.get(key, ()):
        if not replica.is_memory_replica():
            continue
        buf = replica.get_memory_descriptor().buffer_descriptor
        addr, size = int(buf.buffer_address), int(buf.size)
        if size == len(probe) and _readable(addr, size) and ctypes.string_at(addr, size) == probe:
            return str(buf.transport_endpoint)
    return ""


def in_segment(replicas: Any, endpoint: str) -> tuple[int, int] | None:
    """(address, size) of a complete in-memory replica at ``endpoint``, if there is one."""
    complete = mooncake_module().ReplicaStatus.COMPLETE
    for replica in replicas:
        if not replica.is_memory_replica() or replica.status != complete:
            continue
        buf = replica.get_memory_descriptor().buffer_descriptor
        if str(buf.transport_endpoint) == endpoint:
            return int(buf.buffer_address), int(buf.size)
    return None


def _readable(addr: int, size: int) -> bool:
    """Whether [addr, addr + size) lies in one readable mapping of this process."""
    try:
        with open("/proc/self/maps", encoding="ascii") as maps:
            for line in maps:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= addr and addr + size <= hi:
                    return perms.startswith("r")
    except OSError:
        return False
    return False
