"""memcache's client calls at the boundary: its constants and codes, starting a client (setup,
and an ``init`` bounded in time), and splitting a layer's copy into calls of bounded size."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

import numpy as np

from kvflow.bounded import BoundedCaller
from kvflow.errors import ConfigError, MissingDependencyError, StoreError, StoreUnavailableError
from kvflow.stores.base import WriteStatus
from kvflow.stores.memcache.config import LOCAL_CONFIG_ENV, MemcacheConfig
from kvflow.stores.native import BINDING_ERRORS

__all__ = [
    "ADDRESS_LIMIT",
    "COPY_G2H",
    "COPY_G2L",
    "COPY_H2G",
    "COPY_L2G",
    "DOWN",
    "MAX_KEY_BYTES",
    "MISSING",
    "NO_MEMORY",
    "OBJECT_EXISTS",
    "READABLE",
    "WRITE_FAIL",
    "WRITE_OK",
    "alloc_results",
    "copy_batches",
    "copy_directions",
    "copy_in_batches",
    "is_zero",
    "key_info",
    "memcache_module",
    "native_code",
    "start_client",
]

log = logging.getLogger("kvflow")

COPY_L2G, COPY_G2L, COPY_G2H, COPY_H2G = 0, 1, 2, 3  # memcache_hybrid.L2G, G2L, G2H, H2G
READABLE = 1  # batch_get_key_info's flag: only objects whose write has finished
WRITE_OK, WRITE_FAIL = 0, -1  # batch_write_finish's per-key results
MAX_KEY_BYTES = 255
OBJECT_EXISTS = -3006
MISSING = (-3007, -3101)  # a lease refused for an object not stored, or not finished
NO_MEMORY = (-3001, -3013, -3016)  # allocation failed, capacity exceeded, out of memory
DOWN = (-3003, -3004, -3008, -3014, -3017, -3018, -3019)  # service or client not reachable
ADDRESS_LIMIT = 1 << 63


def copy_directions(local_memory: str) -> tuple[int, int]:
    """memcache's copy types (to the pool, from the pool) for KV caches in ``local_memory``:
    ``host`` (H2G, G2H) or ``device`` (L2G, G2L: NPU memory)."""
    if local_memory == "host":
        return COPY_H2G, COPY_G2H
    if local_memory == "device":
        return COPY_L2G, COPY_G2L
    raise ConfigError("local_memory", local_memory, "expected 'host' or 'device'")


def copy_batches(sizes: np.ndarray, max_count: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` index runs covering ``sizes`` in order, each at most ``max_count`` ranges
    and ``max_bytes`` bytes (a single larger range forms a run of its own)."""
    n = int(sizes.size)
    ends = np.cumsum(sizes, dtype=np.int64)
    runs, lo = [], 0
    while lo < n:
        limit = (int(ends[lo - 1]) if lo else 0) + max_bytes
        fit = n if limit >= int(ends[-1]) else int(np.searchsorted(ends, limit, side="right"))
        hi = max(lo + 1, min(lo + max_count, fit))
        runs.append((lo, hi))
        lo = hi
    return runs


def start_client(config: MemcacheConfig) -> Any:
    """A memcache client, set up and initialised: memcache's ``LocalConfig`` from the config's
    URLs, or its own config file (``$MMC_LOCAL_CONFIG_PATH``)."""
    if config.local_config_path:  # memcache reads $MMC_LOCAL_CONFIG_PATH when it is imported
        path = os.path.abspath(config.local_config_path)
        current = os.environ.get(LOCAL_CONFIG_ENV)
        if current and os.path.abspath(current) != path:
            raise ConfigError("local_config_path", path, f"${LOCAL_CONFIG_ENV} names {current}")
        if not current and "memcache_hybrid" in sys.modules:
            why = f"memcache_hybrid was imported before ${LOCAL_CONFIG_ENV} named it: set it first"
            raise ConfigError("local_config_path", path, why)
        os.environ[LOCAL_CONFIG_ENV] = path
    module = memcache_module()
    client = module.DistributedObjectStore()
    if config.local_config_path:
        where = os.path.abspath(config.local_config_path)
    else:
        where = f"meta service {config.meta_service_url}, config store {config.config_store_url}"
        try:
            local = module.LocalConfig()
            for name, value in config.local_config_fields().items():
                setattr(local, name, value)
            rc = client.setup(local)
        except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
            raise StoreError(f"memcache setup for {where} failed: {exc}") from exc
        if rc != 0:
            raise StoreUnavailableError(f"memcache setup for {where} failed", native_code(rc))
    device = config.device_id
    what = f"init on device {device}"
    # init retries forever while the meta service is away: bounded, on a daemon thread
    init = BoundedCaller(
        "memcache",
        config.init_timeout_s,
        timeout_error=lambda what, wait: StoreUnavailableError(
            f"{what} did not return within {wait:g} s (is {where} reachable?)"
        ),
        errors=lambda what, exc: StoreUnavailableError(f"{what} raised: {exc}"),
    )
    try:
        rc = init.call(what, client.init, device, True)
    finally:
        init.shutdown()
    if rc != 0:
        close_quietly(client)
        need = "memcache needs an Ascend NPU and its driver"
        raise StoreUnavailableError(f"memcache {what} failed ({where}; {need})", native_code(rc))
    return client


def close_quietly(client: Any) -> None:
    try:
        client.close()
    except BINDING_ERRORS as exc:
        log.warning("kvflow: closing a memcache client that failed to start: %s", exc)


def memcache_module() -> Any:
    try:
        return importlib.import_module("memcache_hybrid")
    except ImportError as exc:
        raise MissingDependencyError("MemcacheStore", "'kvflow[memcache]'") from exc


def native_code(value: Any) -> int:
    """A native result as a signed int (a code that came through an unsigned type too)."""
    code = int(value)
    return code - (1 << 64) if code >= ADDRESS_LIMIT else code


def is_zero(rc: Any) -> bool:
    return isinstance(rc, (int, np.integer)) and not isinstance(rc, bool) and int(rc) == 0


def alloc_results(answer: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch_alloc``'s answer, per key: the WriteStatus (GRANTED with a GVA, EXISTS,
    NO_SPACE, else FAILED), the GVA (0 when none) and the code (0 with a GVA, and for a
    refusal memcache gives no reason for)."""
    values = [native_code(v) for v in answer]
    gvas = np.array([v if v > 0 else 0 for v in values], dtype=np.int64)
    codes = np.array([min(v, 0) for v in values], dtype=np.int64)
    status = np.full(len(values), WriteStatus.FAILED, dtype=np.int8)
    status[gvas > 0] = WriteStatus.GRANTED
    status[codes == OBJECT_EXISTS] = WriteStatus.EXISTS
    status[np.isin(codes, NO_MEMORY)] = WriteStatus.NO_SPACE
    return status, gvas, codes


def key_info(info: Any) -> tuple[int, int] | None:
    """``batch_get_key_info``'s answer for one key: (GVA, size) of a readable object, or None."""
    try:
        size, gvas = int(info.size()), [int(g) for g in info.gva_list()]
    except (AttributeError, TypeError, ValueError) as exc:
        raise StoreError(f"memcache batch_get_key_info answered {info!r}") from exc
    readable = size > 0 and bool(gvas) and 0 < gvas[0] < ADDRESS_LIMIT
    return (gvas[0], size) if readable else None


def copy_in_batches(
    client: Any,
    direction: int,
    pool: np.ndarray,
    local: np.ndarray,
    sizes: np.ndarray,
    max_count: int,
    max_bytes: int,
) -> tuple[np.ndarray, int, list[int | str]]:
    """The ranges in ``batch_copy`` calls of at most ``max_count`` ranges and ``max_bytes``
    bytes (``copy_batches``): per range whether it moved, how many calls went out, and what
    each failed call answered (its code, or what it raised)."""
    ok = np.zeros(pool.size, dtype=bool)
    bad: list[int | str] = []
    runs = copy_batches(sizes, max_count, max_bytes)
    for lo, hi in runs:
        try:
            rc: Any = client.batch_copy(
                pool[lo:hi].tolist(), local[lo:hi].tolist(), sizes[lo:hi].tolist(), direction
            )
        except BINDING_ERRORS as exc:
            rc = f"{type(exc).__name__}: {exc}"
        ok[lo:hi] = is_zero(rc)
        if not is_zero(rc):
            bad.append(rc)
    return ok, len(runs), bad
