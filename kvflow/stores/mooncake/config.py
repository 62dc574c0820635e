"""MooncakeConfig: how a MooncakeStore joins a Mooncake deployment."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvflow.errors import ConfigError
from kvflow.fields import Config, choice, count, env_values, flag, seconds, size, text

__all__ = ["ENV_PREFIX", "MooncakeConfig"]

ENV_PREFIX = "KVFLOW_MOONCAKE_"  # KVFLOW_MOONCAKE_MASTER_SERVER_ADDRESS=host:port, ...
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"  # the JSON file vLLM's Mooncake connector reads too
DEFAULT_GLOBAL_SEGMENT_SIZE = "1GiB"
DEFAULT_LOCAL_BUFFER_SIZE = "16MiB"
_MIN_SEGMENT = 16 << 20  # Mooncake refuses smaller segments (INVALID_PARAMS at setup)
_PROTOCOLS = ("tcp", "rdma")


def _host_port(address: str) -> str | None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "expected host:port"
    return None


def _segment(size: int) -> str | None:
    return "must be 0 or at least 16 MiB" if 0 < size < _MIN_SEGMENT else None


def _metadata_server(value: str) -> str | None:
    return None if value else "use 'P2PHANDSHAKE' or a URL"


class MooncakeConfig(Config):
    """Settings of a Mooncake client. Keys match Mooncake's own JSON config file.

    Fields:
        master_server_address: ``host:port`` of ``mooncake_master`` (required).
        metadata_server: ``P2PHANDSHAKE`` (no metadata service), or an ``http://``/``etcd://``
            URL.
        protocol: ``tcp`` or ``rdma``.
        device_name: RDMA devices (``""`` for tcp).
        local_hostname: the address other nodes reach this one at (default: this host's name).
        global_segment_size: memory this process gives to the pool (accepts "4GiB"); 0 makes a
            pure client that stores in other processes' segments.
        local_buffer_size: Mooncake's staging buffer for copies it cannot do zero-copy.
        replica_num: copies of each object.
        prefer_local_segment: place new objects in this process's own segment when it has one
            (saves go over local memory; the allocator falls back to other segments when full).
        key_prefix: prepended to every key kvflow stores: separates deployments (or tests)
            that share one Mooncake cluster.
        local_reads: a load of an object held in this process's own segment copies straight
            from it (kvflow's copy loop) instead of through Mooncake's transfer engine.
        local_read_window_s: how long after a load's replica query such direct copies are
            made; later ones go through the transfer engine. Keep it well below the master's
            lease (``--default_kv_lease_ttl``, 5 s by default), which protects the object.
        timeout_s: each metadata call may take this long before the store counts as down.
    """

    master_server_address: str = text(default="", check=_host_port)
    metadata_server: str = text(default="P2PHANDSHAKE", check=_metadata_server)
    protocol: str = choice(_PROTOCOLS, default="tcp")
    device_name: str = text(default="")
    local_hostname: str = text(default="", when_empty=socket.gethostname)
    global_segment_size: int | str = size(default=DEFAULT_GLOBAL_SEGMENT_SIZE, check=_segment)
    local_buffer_size: int | str = size(default=DEFAULT_LOCAL_BUFFER_SIZE)
    replica_num: int = count(default=1)
    prefer_local_segment: bool = flag(default=True)
    key_prefix: str = text(default="")
    timeout_s: float = seconds(default=10.0)
    local_reads: bool = flag(default=True)
    local_read_window_s: float = seconds(default=1.0)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> MooncakeConfig:
        """From a JSON file holding one object of config keys."""
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError("path", str(path), f"cannot read a JSON config: {exc}") from exc
        if not isinstance(values, dict):
            raise ConfigError("path", str(path), "the JSON must be one object of config keys")
        return cls.from_dict(values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MooncakeConfig:
        """From ``$MOONCAKE_CONFIG_PATH`` (a JSON file) if set, then ``KVFLOW_MOONCAKE_<FIELD>``
        variables on top (``KVFLOW_MOONCAKE_MASTER_SERVER_ADDRESS=10.0.0.1:50051``)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if env.get(CONFIG_PATH_ENV):
            base = cls.from_json(env[CONFIG_PATH_ENV])
            values = {f.name: getattr(base, f.name) for f in fields(cls)}
        return cls(**{**values, **env_values(cls, ENV_PREFIX, env)})
