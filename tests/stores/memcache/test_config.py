"""MemcacheConfig: validation with typed errors naming the field, the ways to build one, and what
it hands memcache's LocalConfig. Also the pure helpers: copy types and copy batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvflow
from kvflow.stores.memcache.client import copy_batches, copy_directions
from kvflow.stores.memcache.config import MemcacheConfig

META = "tcp://10.0.0.1:5000"
STORE = "tcp://10.0.0.1:6000"


def urls(**values: object) -> dict[str, object]:
    return {"meta_service_url": META, "config_store_url": STORE, **values}


def test_defaults() -> None:
    cfg = MemcacheConfig(**urls())  # type: ignore[arg-type]
    assert (cfg.protocol, cfg.dram_size, cfg.hbm_size) == ("host_rdma", 1 << 30, 0)
    assert (cfg.device_id, cfg.local_memory, cfg.media, cfg.media_code) == (0, "host", "dram", 1)
    assert (cfg.max_copy_batch, cfg.max_copy_bytes) == (4096, 1 << 30)
    assert cfg.register_buffers and cfg.read_lease_ttl_ms == cfg.write_lease_ttl_ms == 60_000


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("meta_service_url", ""),
        ("meta_service_url", "10.0.0.1:5000"),
        ("meta_service_url", "http://10.0.0.1:5000"),
        ("meta_service_url", "tcp://10.0.0.1:0"),
        ("meta_service_url", "tcp://10.0.0.1:99999"),
        ("config_store_url", ""),
        ("config_store_url", "tcp://host"),
        ("protocol", "tcp"),
        ("log_level", "verbose"),
        ("local_memory", "npu"),
        ("media", "ssd"),
        ("dram_size", "2TiB"),
        ("dram_size", "lots"),
        ("dram_size", -1),
        ("hbm_size", 1.5),
        ("world_size", 0),
        ("world_size", True),
        ("device_id", -1),
        ("device_id", "0"),
        ("max_copy_batch", 0),
        ("max_copy_bytes", 0),
        ("write_lease_ttl_ms", 0),
        ("read_lease_ttl_ms", 10**12),
        ("read_lease_ttl_ms", 2.5),
        ("register_buffers", "yes"),
        ("key_prefix", 3),
        ("key_prefix", "p" * 129),
        ("timeout_s", 0),
        ("timeout_s", float("inf")),
        ("init_timeout_s", -1),
    ],
)
def test_bad_values_are_config_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(kvflow.ConfigError) as err:
        MemcacheConfig(**urls(**{field: value}))  # type: ignore[arg-type]
    assert err.value.argument == field
    assert err.value.value == value or field in str(err.value)


def test_both_sizes_zero_is_refused() -> None:
    with pytest.raises(kvflow.ConfigError, match="both 0"):
        MemcacheConfig(**urls(dram_size=0, hbm_size="0"))  # type: ignore[arg-type]
    cfg = MemcacheConfig(**urls(dram_size=0, hbm_size="8GiB", media="hbm"))  # type: ignore[arg-type]
    assert (cfg.dram_size, cfg.hbm_size, cfg.media_code) == (0, 8 << 30, 0)


def test_a_config_file_instead_of_the_urls(tmp_path: Path) -> None:
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.meta_service_url = tcp://10.0.0.1:5000\n")
    cfg = MemcacheConfig(local_config_path=str(conf))
    assert cfg.meta_service_url == ""
    with pytest.raises(kvflow.ConfigError, match="local_config_path or the URLs") as err:
        MemcacheConfig(local_config_path=str(conf), meta_service_url=META)
    assert err.value.argument == "meta_service_url"
    with pytest.raises(kvflow.ConfigError) as err:
        MemcacheConfig(local_config_path=str(tmp_path / "absent.conf"))
    assert err.value.argument == "local_config_path"


def test_local_config_fields_are_memcache_s_names_and_formats() -> None:
    cfg = MemcacheConfig(**urls(protocol="host_tcp", dram_size="64MiB", timeout_s=2.5))  # type: ignore[arg-type]
    assert cfg.local_config_fields() == {
        "meta_service_url": META,
        "config_store_url": STORE,
        "protocol": "host_tcp",
        "dram_size": str(64 << 20),
        "hbm_size": "0",
        "world_size": 256,
        "log_level": "info",
        "client_timeout_seconds": 3,
    }


def test_from_dict_refuses_unknown_keys_and_lists_the_known_ones() -> None:
    with pytest.raises(kvflow.ConfigError) as err:
        MemcacheConfig.from_dict({**urls(), "meta": "x"})
    assert "meta" in str(err.value) and "device_id" in str(err.value)


def test_from_env(tmp_path: Path) -> None:
    cfg = MemcacheConfig.from_env(
        {
            "KVFLOW_MEMCACHE_META_SERVICE_URL": META,
            "KVFLOW_MEMCACHE_CONFIG_STORE_URL": STORE,
            "KVFLOW_MEMCACHE_DEVICE_ID": "3",
            "KVFLOW_MEMCACHE_DRAM_SIZE": "2GiB",
            "KVFLOW_MEMCACHE_REGISTER_BUFFERS": "0",
            "KVFLOW_MEMCACHE_TIMEOUT_S": "2.5",
            "MMC_LOCAL_CONFIG_PATH": "/ignored/when/the/urls/are/given",
        }
    )
    assert (cfg.device_id, cfg.dram_size, cfg.register_buffers, cfg.timeout_s) == (
        3,
        2 << 30,
        False,
        2.5,
    )
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("")
    cfg = MemcacheConfig.from_env({"MMC_LOCAL_CONFIG_PATH": str(conf)})
    assert cfg.local_config_path == str(conf)
    for name, raw in [("DEVICE_ID", "zero"), ("TIMEOUT_S", "soon"), ("REGISTER_BUFFERS", "?")]:
        env = {"MMC_LOCAL_CONFIG_PATH": str(conf), f"KVFLOW_MEMCACHE_{name}": raw}
        with pytest.raises(kvflow.ConfigError, match=name):
            MemcacheConfig.from_env(env)


def test_store_takes_a_config_or_options_not_both() -> None:
    with pytest.raises(kvflow.InvalidArgumentError, match="options"):
        kvflow.MemcacheStore(MemcacheConfig(**urls()), device_id=2)  # type: ignore[arg-type]


def test_copy_directions() -> None:
    assert copy_directions("host") == (3, 2)  # H2G, G2H
    assert copy_directions("device") == (0, 1)  # L2G, G2L
    with pytest.raises(kvflow.ConfigError):
        copy_directions("npu")


@pytest.mark.parametrize(
    ("sizes", "max_count", "max_bytes", "runs"),
    [
        ([], 4, 100, []),
        ([10] * 5, 2, 1000, [(0, 2), (2, 4), (4, 5)]),
        ([10] * 5, 10, 25, [(0, 2), (2, 4), (4, 5)]),
        ([10, 500, 10, 10], 10, 100, [(0, 1), (1, 2), (2, 4)]),  # a large range goes alone
        ([0, 0, 7], 2, 1, [(0, 2), (2, 3)]),
        ([5] * 4, 4, 20, [(0, 4)]),
    ],
)
def test_copy_batches(
    sizes: list[int], max_count: int, max_bytes: int, runs: list[tuple[int, int]]
) -> None:
    assert copy_batches(np.array(sizes, dtype=np.int64), max_count, max_bytes) == runs
