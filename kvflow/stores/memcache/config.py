"""MemcacheConfig: how a MemcacheStore joins an Ascend memcache (MemFabric Hybrid) deployment."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from kvflow.errors import ConfigError
from kvflow.fields import Config, choice, count, env_values, flag, path, seconds, size, text

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
_URLS = ("meta_service_url", "config_store_url")


def _readable(path: str) -> str | None:
    return "not a readable file" if path and not os.path.isfile(path) else None


def _short(prefix: str) -> str | None:
    return f"at most {MAX_KEY_PREFIX} bytes" if len(prefix.encode()) > MAX_KEY_PREFIX else None


class MemcacheConfig(Config):
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

    meta_service_url: str = text(default="")
    config_store_url: str = text(default="")
    local_config_path: str = path(default="", check=_readable)
    protocol: str = choice(PROTOCOLS, default="host_rdma")
    dram_size: int | str = size(default="1GiB", high=MAX_DRAM)
    hbm_size: int | str = size(default=0)
    world_size: int = count(default=256)
    log_level: str = choice(LOG_LEVELS, default="info")
    device_id: int = count(default=0, low=0)
    local_memory: str = choice(LOCAL_MEMORY, default="host")
    media: str = choice(tuple(MEDIA), default="dram")
    max_copy_batch: int = count(default=4096)
    max_copy_bytes: int | str = size(default="1GiB", low=1)
    write_lease_ttl_ms: int = count(default=60_000, high=MAX_LEASE_MS)
    read_lease_ttl_ms: int = count(default=60_000, high=MAX_LEASE_MS)
    register_buffers: bool = flag(default=True)
    key_prefix: str = text(default="", check=_short)
    timeout_s: float = seconds(default=10.0)
    init_timeout_s: float = seconds(default=60.0)

    def __post_init__(self) -> None:
        """The checks across fields: the client's one source, and some memory to give."""
        self._check_source()
        if self.dram_size == 0 and self.hbm_size == 0:
            raise ConfigError("dram_size", self.dram_size, "dram_size and hbm_size are both 0")

    def _check_source(self) -> None:
        urls = {name: getattr(self, name) for name in _URLS}
        if self.local_config_path:
            given = [name for name, url in urls.items() if url]
            if given:
                raise ConfigError(given[0], urls[given[0]], "give local_config_path or the URLs")
            return
        for name, url in urls.items():
            match = _URL.match(url)
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
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MemcacheConfig:
        """From ``KVFLOW_MEMCACHE_<FIELD>`` variables (``KVFLOW_MEMCACHE_DEVICE_ID=3``). Without
        the two URLs among them, ``$MMC_LOCAL_CONFIG_PATH`` (memcache's own variable) names
        the client's config file."""
        env = os.environ if environ is None else environ
        values = env_values(cls, ENV_PREFIX, env)
        given = any(values.get(name) for name in (*_URLS, "local_config_path"))
        if not given and env.get(LOCAL_CONFIG_ENV):
            values["local_config_path"] = env[LOCAL_CONFIG_ENV]
        return cls(**values)
