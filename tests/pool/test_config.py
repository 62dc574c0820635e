"""kvflow.pool.config: PoolConfig's and SharedStoreConfig's defaults, what they accept and hold,
and their refusals naming the field; the former ``kvflow.pool.store_config`` warns on import."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any

import pytest

from kvflow import ConfigError
from kvflow.pool.config import PoolConfig, SharedStoreConfig
from kvflow.pool.paths import SOCKET_ENV

SOCKET = "/tmp/kvf-test/pool.sock"  # the default socket, from $KVFLOW_POOL_SOCKET


@pytest.fixture(autouse=True)
def default_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SOCKET_ENV, SOCKET)


def test_defaults() -> None:
    assert dataclasses.asdict(PoolConfig()) == {
        "socket": SOCKET,
        "capacity": 1 << 30,
        "lease_ttl_s": 300.0,
        "allow_uids": (),
        "socket_mode": 0o600,
        "max_clients": 256,
        "idle_timeout_s": 60.0,
        "disk_dir": "",
        "disk_capacity": 0,
        "disk_reads": "layerwise",
    }
    assert dataclasses.asdict(SharedStoreConfig()) == {
        "socket": SOCKET,
        "timeout_s": 5.0,
        "retry_interval_s": 0.5,
        "auto_start": False,
        "capacity": 1 << 30,
        "lease_ttl_s": 300.0,
        "start_timeout_s": 60.0,
        "populate": False,
        "server_uids": (),
        "pin": None,
        "disk_dir": "",
        "disk_capacity": 0,
        "disk_reads": "layerwise",
    }


def test_values_are_held_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/tmp")
    pool = PoolConfig(socket="p.sock", capacity="8MiB", lease_ttl_s=2, allow_uids=(7, 8))
    client = SharedStoreConfig.from_dict({"capacity": "1KiB", "server_uids": [9], "pin": True})
    server = SharedStoreConfig(capacity="4MiB", lease_ttl_s=9).server_config()

    assert (pool.socket, pool.size, pool.lease_ttl_s, pool.allow_uids) == (
        "/tmp/p.sock",
        8 << 20,
        2.0,
        (7, 8),
    )
    assert (client.capacity, client.server_uids, client.pin) == (1024, (9,), True)
    assert (server.socket, server.capacity, server.lease_ttl_s) == (SOCKET, 4 << 20, 9.0)


def test_a_socket_not_given_is_the_default_one() -> None:
    """None (a JSON null in kv_connector_extra_config) and "" both mean the default path."""
    assert SharedStoreConfig(socket=None).socket == SOCKET  # type: ignore[arg-type]
    assert SharedStoreConfig.from_dict({"socket": ""}).socket == SOCKET
    assert PoolConfig(socket=None).socket == SOCKET  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "values", "field", "reason"),
    [
        (PoolConfig, {"socket": "/tmp/" + "s" * 103}, "socket", "is longer than 107 bytes"),
        (SharedStoreConfig, {"socket": "/tmp/" + "s" * 103}, "socket", "longer than 107"),
        (PoolConfig, {"capacity": "1KiB"}, "capacity", "must be at least 4 KiB"),
        (SharedStoreConfig, {"capacity": -1}, "capacity", "must not be negative"),
        (PoolConfig, {"socket_mode": 0o1000}, "socket_mode", "permission bits such as 0o600"),
        (PoolConfig, {"socket_mode": 0}, "socket_mode", "permission bits such as 0o600"),
        (PoolConfig, {"max_clients": 0}, "max_clients", "must be an integer >= 1"),
        (PoolConfig, {"idle_timeout_s": 0}, "idle_timeout_s", "seconds > 0"),
        (PoolConfig, {"allow_uids": [-1]}, "allow_uids", "user ids must be integers >= 0"),
        (SharedStoreConfig, {"timeout_s": float("inf")}, "timeout_s", "must be finite"),
        (SharedStoreConfig, {"auto_start": "yes"}, "auto_start", "must be true or false"),
        (SharedStoreConfig, {"pin": "yes"}, "pin", "must be true or false"),
        (SharedStoreConfig, {"server_uids": 5}, "server_uids", "list of user ids"),
    ],
)
def test_refusals_name_the_field(
    config: type[Any], values: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        config(**values)
    assert info.value.argument == field


def test_unknown_keys_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"known keys are .*'socket_mode'") as info:
        PoolConfig.from_dict({"sockets": "/tmp/x.sock"})
    assert info.value.value == ["sockets"]


def test_the_former_module_warns_on_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "kvflow.pool.store_config", raising=False)
    with pytest.warns(DeprecationWarning, match="kvflow.pool.config"):
        module = importlib.import_module("kvflow.pool.store_config")
    assert module.SharedStoreConfig is SharedStoreConfig
