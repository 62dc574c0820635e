"""MooncakeConfig: how a MooncakeStore joins a Mooncake deployment."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvflow.config import _positive_float, from_dict, parse_size
from kvflow.errors import ConfigError

__all__ = ["ENV_PREFIX", "MooncakeConfig"]

ENV_PREFIX = "KVFLOW_MOONCAKE_"  # KVFLOW_MOONCAKE_MASTER_SERVER_ADDRESS=host:port, ...
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"  # the JSON file vLLM's Mooncake connector reads too
DEFAULT_GLOBAL_SEGMENT_SIZE = "1GiB"
DEFAULT_LOCAL_BUFFER_SIZE = "16MiB"
_MIN_SEGMENT = 16 << 20  # Mooncake refuses smaller segments (INVALID_PARAMS at setup)
_PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeConfig:
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

    master_server_address: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = ""
    global_segment_size: int | str = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int | str = DEFAULT_LOCAL_BUFFER_SIZE
    replica_num: int = 1
    prefer_local_segment: bool = True
    key_prefix: str = ""
    timeout_s: float = 10.0
    local_reads: bool = True
    local_read_window_s: float = 1.0

    def __post_init__(self) -> None:
        master = self.master_server_address
        host, _, port = master.rpartition(":") if isinstance(master, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("master_server_address", master, "expected host:port")
        for name in ("metadata_server", "device_name", "local_hostname", "key_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "must be a string")
        if not self.metadata_server:
            raise ConfigError("metadata_server", "", "use 'P2PHANDSHAKE' or a URL")
        if self.protocol not in _PROTOCOLS:
            raise ConfigError("protocol", self.protocol, f"expected one of {_PROTOCOLS}")
        if not self.local_hostname:
            object.__setattr__(self, "local_hostname", socket.gethostname())
        segment = parse_size(self.global_segment_size, argument="global_segment_size")
        if 0 < segment < _MIN_SEGMENT:
            raise ConfigError("global_segment_size", segment, "must be 0 or at least 16 MiB")
        object.__setattr__(self, "global_segment_size", segment)
        buffer = parse_size(self.local_buffer_size, argument="local_buffer_size")
        object.__setattr__(self, "local_buffer_size", buffer)
        replicas = self.replica_num
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError("replica_num", replicas, "must be an integer >= 1")
        for name in ("prefer_local_segment", "local_reads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "must be a bool")
        _positive_float("timeout_s", self.timeout_s)
        _positive_float("local_read_window_s", self.local_read_window_s)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MooncakeConfig:
        """From a plain dict; unknown keys are an error that lists the known ones."""
        return from_dict(cls, dict(values))

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
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            if f.name == "replica_num":
                if not raw.strip().isdigit():
                    raise ConfigError(ENV_PREFIX + "REPLICA_NUM", raw, "must be an integer")
                values[f.name] = int(raw)
            elif f.name in ("prefer_local_segment", "local_reads"):
                flag = raw.strip().lower()
                if flag not in ("1", "0", "true", "false", "yes", "no"):
                    raise ConfigError(ENV_PREFIX + f.name.upper(), raw, "must be 1 or 0")
                values[f.name] = flag in ("1", "true", "yes")
            elif f.name in ("timeout_s", "local_read_window_s"):
                try:
                    values[f.name] = float(raw)
                except ValueError:
                    raise ConfigError(
                        ENV_PREFIX + f.name.upper(), raw, "must be a number"
                    ) from None
            else:
                values[f.name] = raw
        return cls(**values)
