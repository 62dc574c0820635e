"""MemcacheConfig: how a MemcacheStore joins an Ascend memcache (MemFabric Hybrid) deployment."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvflow.config import _positive_float, from_dict, parse_size
from kvflow.errors import ConfigError

__all__ = ["ENV_PREFIX", "LOCAL_CONFIG_ENV", "MemcacheConfig"]

ENV_PREFIX = "KVFLOW_MEMCACHE_"  # KVFLOW_MEMCACHE_META_SERVICE_URL=tcp://10.0.0.1:5000, ...
LOCAL_CONFIG_ENV = "MMC_LOCAL_CONFIG_PATH"  # the mmc-local.conf memcache's client reads itself
PROTOCOLS = (
    "host_rdma",
    "host_urma",
    "host_tcp",
    "host_shm",
    "device_rdma",
    "device_urma",
    "device_uboe",
    "device_sdma",
)
LOCAL_MEMORY = ("host", "device")
MEDIA = {"hbm": 0, "dram": 1}  # batch_alloc's media argument
LOG_LEVELS = ("debug", "info", "warn", "error")
MAX_DRAM = 1 << 40  # memcache refuses more than 1 TB of DRAM per process
MAX_KEY_PREFIX = 128  # memcache keys are shorter than 256 bytes, the prefix included
MAX_LEASE_MS = 24 * 3600 * 1000
_URL = re.compile(r"^tcp://([^\s:/]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")
_INT_FIELDS = (
    "device_id",
    "world_size",
    "max_copy_batch",
    "write_lease_ttl_ms",
    "read_lease_ttl_ms",
)
_FLOAT_FIELDS = ("timeout_s", "init_timeout_s")
_BOOL_FIELDS = ("register_buffers",)


@dataclass(frozen=True)
class MemcacheConfig:
    """Settings of a memcache client, and how kvflow drives it.

    The client is set up one of two ways: from ``meta_service_url`` and ``config_store_url``
    (with ``protocol``, ``dram_size``, ``hbm_size``, ``world_size``, ``log_level``), which
    kvflow passes to memcache's ``LocalConfig``; or from ``local_config_path``, an
    ``mmc-local.conf`` file memcache reads itself (kvflow points ``$MMC_LOCAL_CONFIG_PATH`` at
    it). Give one, not both.

    Fields:
        meta_service_url: ``tcp://host:port`` of the meta service
            (``ock.mmc.meta_service_url``).
        config_store_url: ``tcp://host:port`` of the meta service's config store
            (``ock.mmc.local_service.config_store_url``).
        local_config_path: an ``mmc-local.conf`` file instead of the fields above.
        protocol: memcache's data transfer protocol (``host_rdma``, ``host_tcp``,
            ``device_sdma``, ...; see ``PROTOCOLS``).
        dram_size: host memory this process gives to the pool (accepts "4GiB"; at most 1 TiB).
        hbm_size: device memory this process gives to the pool; not both sizes may be 0.
        world_size: the most processes (ranks) the deployment will hold.
        log_level: memcache's own log level (``debug``, ``info``, ``warn``, ``error``).
        device_id: the NPU the client binds (``init(device_id)``; ``ASCEND_RT_VISIBLE_DEVICES``
            numbering).
        local_memory: where the KV caches kvflow registers live: ``host`` (copies are H2G and
            G2H) or ``device`` (NPU memory: L2G and G2L). CPU tensors are ``host``.
        media: where new objects are allocated: ``dram`` or ``hbm``.
        max_copy_batch: one memcache ``batch_copy`` call carries at most this many ranges.
        max_copy_bytes: ... and at most this many bytes (a single larger range goes alone).
        write_lease_ttl_ms: the lease ``batch_alloc`` takes on new objects: a save must finish
            (``batch_write_finish``) within it.
        read_lease_ttl_ms: the lease ``batch_add_lease`` takes for a load; a copy that ends
            after it (less a safety margin) fails its chunk instead of passing bytes off.
        register_buffers: register the KV caches with ``register_buffer`` (device RDMA needs
            it; set false where the protocol refuses registration of host memory).
        key_prefix: prepended to every key: separates deployments sharing one memcache.
        timeout_s: each metadata call may take this long before the store counts as down
            (also memcache's own ``client_timeout_seconds``, rounded up).
        init_timeout_s: the client's ``init`` may take this long (it retries the config store
            while the meta service is away).
    """

    meta_service_url: str = ""
    config_store_url: str = ""
    local_config_path: str = ""
    protocol: str = "host_rdma"
    dram_size: int | str = "1GiB"
    hbm_size: int | str = 0
    world_size: int = 256
    log_level: str = "info"
    device_id: int = 0
    local_memory: str = "host"
    media: str = "dram"
    max_copy_batch: int = 4096
    max_copy_bytes: int | str = "1GiB"
    write_lease_ttl_ms: int = 60_000
    read_lease_ttl_ms: int = 60_000
    register_buffers: bool = True
    key_prefix: str = ""
    timeout_s: float = 10.0
    init_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self._check_source()
        for name in ("meta_service_url", "config_store_url", "local_config_path", "key_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "must be a string")
        _choice("protocol", self.protocol, PROTOCOLS)
        _choice("log_level", self.log_level, LOG_LEVELS)
        _choice("local_memory", self.local_memory, LOCAL_MEMORY)
        _choice("media", self.media, tuple(MEDIA))
        dram = parse_size(self.dram_size, argument="dram_size")
        hbm = parse_size(self.hbm_size, argument="hbm_size")
        if dram > MAX_DRAM:
            raise ConfigError("dram_size", self.dram_size, "memcache takes at most 1 TiB")
        if dram == 0 and hbm == 0:
            raise ConfigError("dram_size", self.dram_size, "dram_size and hbm_size are both 0")
        object.__setattr__(self, "dram_size", dram)
        object.__setattr__(self, "hbm_size", hbm)
        for name in ("world_size", "max_copy_batch"):
            _int_at_least(name, getattr(self, name), 1)
        _int_at_least("device_id", self.device_id, 0)
        for name in ("write_lease_ttl_ms", "read_lease_ttl_ms"):
            _int_at_least(name, getattr(self, name), 1)
            if getattr(self, name) > MAX_LEASE_MS:
                raise ConfigError(name, getattr(self, name), "must be at most a day")
        copy_bytes = parse_size(self.max_copy_bytes, argument="max_copy_bytes")
        if copy_bytes < 1:
            raise ConfigError("max_copy_bytes", self.max_copy_bytes, "must be >= 1 byte")
        object.__setattr__(self, "max_copy_bytes", copy_bytes)
        if not isinstance(self.register_buffers, bool):
            raise ConfigError("register_buffers", self.register_buffers, "must be true or false")
        if len(self.key_prefix.encode()) > MAX_KEY_PREFIX:
            raise ConfigError("key_prefix", self.key_prefix, f"at most {MAX_KEY_PREFIX} bytes")
        _positive_float("timeout_s", self.timeout_s)
        _positive_float("init_timeout_s", self.init_timeout_s)

    def _check_source(self) -> None:
        path = self.local_config_path
        urls = {
            "meta_service_url": self.meta_service_url,
            "config_store_url": self.config_store_url,
        }
        if path:
            if not isinstance(path, str) or not os.path.isfile(path):
                raise ConfigError("local_config_path", path, "not a readable file")
            given = [name for name, url in urls.items() if url]
            if given:
                raise ConfigError(given[0], urls[given[0]], "give local_config_path or the URLs")
            return
        for name, url in urls.items():
            match = _URL.match(url) if isinstance(url, str) else None
            if match is None or not 0 < int(match.group(2)) < 65536:
                hint = "expected tcp://host:port" if url else "required (or local_config_path)"
                raise ConfigError(name, url, hint)

    @property
    def media_code(self) -> int:
        """``batch_alloc``'s media argument."""
        return MEDIA[self.media]

    def local_config_fields(self) -> dict[str, Any]:
        """The attributes of memcache's ``LocalConfig`` this config sets (URL mode only)."""
        return {
            "meta_service_url": self.meta_service_url,
            "config_store_url": self.config_store_url,
            "protocol": self.protocol,
            "dram_size": str(self.dram_size),
            "hbm_size": str(self.hbm_size),
            "world_size": self.world_size,
            "log_level": self.log_level,
            "client_timeout_seconds": max(1, math.ceil(self.timeout_s)),
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MemcacheConfig:
        """From a plain dict; unknown keys are an error that lists the known ones."""
        return from_dict(cls, dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MemcacheConfig:
        """From ``KVFLOW_MEMCACHE_<FIELD>`` variables (``KVFLOW_MEMCACHE_DEVICE_ID=3``). Without
        the two URLs among them, ``$MMC_LOCAL_CONFIG_PATH`` (memcache's own variable) names
        the client's config file."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse_env(f.name, raw)
        urls = ("meta_service_url", "config_store_url", "local_config_path")
        if not any(values.get(name) for name in urls) and env.get(LOCAL_CONFIG_ENV):
            values["local_config_path"] = env[LOCAL_CONFIG_ENV]
        return cls(**values)


def _parse_env(name: str, raw: str) -> Any:
    variable = ENV_PREFIX + name.upper()
    text = raw.strip()
    if name in _INT_FIELDS:
        if not text.isdigit():
            raise ConfigError(variable, raw, "must be an integer")
        return int(text)
    if name in _FLOAT_FIELDS:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(variable, raw, "must be a number") from None
    if name in _BOOL_FIELDS:
        if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(variable, raw, "must be 1 or 0")
        return text.lower() in ("1", "true", "yes")
    return raw


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"expected one of {allowed}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(name, value, f"must be an integer >= {low}")
