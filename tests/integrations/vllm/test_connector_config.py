"""ConnectorConfig, the vLLM connector's ``kv_connector_extra_config``, without vLLM.

What is tested: the defaults; unknown keys refused with the known ones listed; every bad value
refused with a ConfigError naming its field; ``copy_cpus`` normalised to a tuple, and
``"auto"`` resolved on the model's thread (the CPUs it is not bound to; none for accelerator
caches); the automatic chunk size; ``engine_config`` carrying the connector's engine fields;
the shared pool's ``auto_start`` default and override; Mooncake settings from keys or the
environment, and the scheduler's pure-client variant (no segment).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

import kvflow.config
from kvflow import ConfigError, EngineConfig
from kvflow.integrations.vllm.config import ConnectorConfig

MASTER = "127.0.0.1:50051"
MOONCAKE_ENV = ("KVFLOW_MOONCAKE_", "MOONCAKE_CONFIG_PATH")


@pytest.fixture
def clean_mooncake_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No Mooncake settings from the environment unless the test sets them."""
    for name in list(os.environ):
        if name.startswith(MOONCAKE_ENV):
            monkeypatch.delenv(name)
    return monkeypatch


def some_cpu() -> int:
    """A CPU this process may run on (copy_cpus are checked against the affinity mask)."""
    return min(os.sched_getaffinity(0))


def config_error(extra: dict[str, Any]) -> ConfigError:
    """The ConfigError that ``extra`` raises."""
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_extra_config(extra)
    return info.value


# -- defaults and keys ------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [None, {}])
def test_defaults(extra: dict[str, Any] | None) -> None:
    config = ConnectorConfig.from_extra_config(extra)

    assert config == ConnectorConfig()
    assert config.store == "shared"
    assert config.chunk_blocks == 0
    assert config.use_layerwise is True
    assert config.save is True
    assert config.load is True
    assert config.local_capacity == 4 << 30
    assert config.copy_cpus == "auto"
    assert config.lookup_timeout_s == 2.0
    assert config.inline_saves is True
    assert config.deferred_saves is True
    assert config.model == ""
    assert config.debug_corrupt_loads is False
    assert config.shared_config().auto_start is True


def test_config_is_frozen() -> None:
    config = ConnectorConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.store = "local"  # type: ignore[misc]


def test_every_key_is_accepted() -> None:
    extra: dict[str, Any] = {
        "store": "local",
        "shared": {"capacity": "1GiB"},
        "mooncake": {},
        "memcache": {},
        "local_capacity": "64MiB",
        "chunk_blocks": 4,
        "tail_chunks": False,
        "use_layerwise": False,
        "save": False,
        "load": False,
        "save_decode_cache": True,
        "prefetch_layers": 3,
        "save_backlog": 5,
        "copy_threads": 2,
        "copy_cpus": [some_cpu()],
        "op_timeout_s": 7.5,
        "copy_timeout_s": 3,
        "inline_saves": False,
        "deferred_saves": False,
        "save_across_steps": True,
        "lookup_timeout_s": 0.25,
        "model": "tiny",
        "debug_corrupt_loads": True,
        "debug_fail_loads": True,
        "debug_skip_saves": True,
        "debug_rank": 1,
    }
    assert set(extra) == {f.name for f in dataclasses.fields(ConnectorConfig)}

    config = ConnectorConfig.from_extra_config(extra)

    for name, value in extra.items():
        if name == "copy_cpus":
            assert config.copy_cpus == tuple(value)
        elif name == "local_capacity":
            assert config.local_capacity == 64 << 20
        else:
            assert getattr(config, name) == value, name


def test_unknown_key_lists_the_known_ones() -> None:
    err = config_error({"store": "local", "chunk_size": 4})

    message = str(err)
    assert "chunk_size" in message
    for f in dataclasses.fields(ConnectorConfig):
        assert f.name in message, f.name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", "redis"),
        ("store", ""),
        ("shared", "socket=/tmp/x"),
        ("shared", ["capacity"]),
        ("mooncake", 5),
        ("memcache", "tcp://x"),
        ("local_capacity", "lots"),
        ("local_capacity", -1),
        ("local_capacity", 1.5),
        ("chunk_blocks", -1),
        ("chunk_blocks", 1.5),
        ("chunk_blocks", True),
        ("chunk_blocks", "4"),
        ("use_layerwise", "yes"),
        ("use_layerwise", 1),
        ("save", None),
        ("load", 0),
        ("save_decode_cache", "true"),
        ("debug_corrupt_loads", "true"),
        ("debug_skip_saves", 1),
        ("debug_rank", -1),
        ("debug_rank", "1"),
        ("debug_rank", True),
        ("prefetch_layers", 0),
        ("save_backlog", -2),
        ("copy_threads", 0),
        ("copy_threads", 1.0),
        ("copy_cpus", [-1]),
        ("copy_cpus", ["0"]),
        ("copy_cpus", "0"),
        ("copy_cpus", 3),
        ("copy_cpus", None),
        ("copy_cpus", [1 << 20]),  # no such CPU
        ("op_timeout_s", 0),
        ("copy_timeout_s", -1.0),
        ("copy_timeout_s", float("nan")),
        ("lookup_timeout_s", 0),
        ("lookup_timeout_s", "2"),
        ("lookup_timeout_s", float("inf")),
        ("model", 3),
        ("model", None),
    ],
)
def test_bad_value_names_its_field(field: str, value: Any) -> None:
    err = config_error({field: value})

    assert err.argument == field


@pytest.mark.parametrize(
    ("role", "save", "save_decode_cache", "saves"),
    [
        ("kv_both", True, False, True),
        ("kv_producer", True, False, True),
        ("kv_consumer", True, False, False),
        ("kv_consumer", True, True, True),
        ("kv_producer", False, False, False),
        ("kv_consumer", False, True, False),
    ],
)
def test_what_each_kv_role_saves(
    role: str, save: bool, save_decode_cache: bool, saves: bool
) -> None:
    config = ConnectorConfig(save=save, save_decode_cache=save_decode_cache)

    assert config.saves_as(role) is saves


@pytest.mark.parametrize("role", ["kv_prefill", "", None, "KV_BOTH", 1])
def test_an_unknown_kv_role_is_refused_naming_the_accepted_ones(role: Any) -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorConfig().saves_as(role)

    assert info.value.argument == "kv_role"
    assert info.value.value == role
    for accepted in ("kv_producer", "kv_consumer", "kv_both"):
        assert accepted in str(info.value)


@pytest.mark.parametrize(
    ("shared", "inner"),
    [({"timeout_s": 0}, "timeout_s"), ({"capacity": "huge"}, "capacity"), ({"bogus": 1}, "bogus")],
)
def test_bad_shared_settings_are_refused_at_once(shared: dict[str, Any], inner: str) -> None:
    err = config_error({"shared": shared})

    assert inner in str(err)


@pytest.mark.parametrize(
    ("mooncake", "inner"),
    [
        ({"master_server_address": "no-port"}, "master_server_address"),
        ({"master_server_address": MASTER, "protocol": "udp"}, "protocol"),
        ({"master_server_address": MASTER, "global_segment_size": "1MiB"}, "global_segment"),
        ({"master_server_address": MASTER, "bogus": 1}, "bogus"),
    ],
)
def test_bad_mooncake_settings_are_refused_at_once(mooncake: dict[str, Any], inner: str) -> None:
    err = config_error({"store": "mooncake", "mooncake": mooncake})

    assert inner in str(err)


def test_copy_cpus_list_becomes_a_tuple() -> None:
    cpu = some_cpu()

    config = ConnectorConfig.from_extra_config({"copy_cpus": [cpu]})

    assert config.copy_cpus == (cpu,)
    assert isinstance(config.copy_cpus, tuple)
    assert ConnectorConfig(copy_cpus=[cpu]).copy_cpus == (cpu,)  # type: ignore[arg-type]


def test_auto_copy_cpus_keep_off_the_model_threads_cores(bound_to_one_cpu: int) -> None:
    config = ConnectorConfig()

    cpus = config.copy_cpus_here("cpu")

    assert cpus == kvflow.spare_cpus()
    assert cpus and bound_to_one_cpu not in cpus
    assert config.engine_config(block_size=16, model="m", copy_cpus=cpus).copy_cpus == cpus


def test_auto_copy_cpus_pin_nothing_for_accelerator_caches(bound_to_one_cpu: int) -> None:
    assert ConnectorConfig().copy_cpus_here("cuda:0") == ()
    assert ConnectorConfig().copy_cpus_here("npu") == ()


def test_engine_config_without_resolved_cpus_pins_nothing_for_auto() -> None:
    """Only the worker resolves "auto" (after vLLM bound its threads); a config built
    elsewhere (the scheduler, the checks) pins nothing."""
    assert ConnectorConfig().engine_config(block_size=16, model="m").copy_cpus == ()


def test_explicit_copy_cpus_win_over_auto(bound_to_one_cpu: int) -> None:
    """``[]``: no pinning, the copy threads inherit the model thread's core; a list: that."""
    cpu = bound_to_one_cpu
    assert ConnectorConfig(copy_cpus=[]).copy_cpus_here("cpu") == ()  # type: ignore[arg-type]
    assert ConnectorConfig(copy_cpus=[cpu]).copy_cpus_here("cpu") == (cpu,)  # type: ignore[arg-type]
    listed = ConnectorConfig.from_extra_config({"copy_cpus": [cpu]})
    assert listed.engine_config(block_size=16, model="m").copy_cpus == (cpu,)


# -- derived configs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_blocks", "block_size", "expected"),
    [
        (0, 16, 4),  # 64 tokens
        (0, 32, 2),
        (0, 64, 1),
        (0, 24, 2),  # rounded down
        (0, 1, 64),
        (0, 48, 1),
        (0, 1024, 1),  # a block larger than 64 tokens: still one block
        (3, 16, 3),  # an explicit value wins
        (1, 1024, 1),
    ],
)
def test_chunk_blocks_for(chunk_blocks: int, block_size: int, expected: int) -> None:
    config = ConnectorConfig(chunk_blocks=chunk_blocks)

    assert config.chunk_blocks_for(block_size) == expected
    assert config.engine_config(block_size=block_size, model="m").chunk_blocks == expected


def test_engine_config_carries_the_engine_fields() -> None:
    cpu = some_cpu()
    config = ConnectorConfig.from_extra_config(
        {
            "prefetch_layers": 3,
            "save_backlog": 6,
            "copy_threads": 2,
            "copy_cpus": [cpu],
            "op_timeout_s": 12.5,
            "copy_timeout_s": 4.0,
            "inline_saves": False,
            "deferred_saves": False,
        }
    )

    engine = config.engine_config(block_size=32, model="served-name", rank=3)

    assert isinstance(engine, EngineConfig)
    assert engine.model == "served-name"
    assert engine.rank == 3
    assert engine.chunk_blocks == 2  # 64 tokens of 32-token blocks
    assert engine.prefetch_layers == 3
    assert engine.save_backlog == 6
    assert engine.copy_threads == 2
    assert engine.copy_cpus == (cpu,)
    assert engine.op_timeout_s == 12.5
    assert engine.copy_timeout_s == 4.0
    assert engine.inline_saves is False and engine.deferred_saves is False
    default = ConnectorConfig().engine_config(block_size=32, model="m")
    assert default.inline_saves is True and default.deferred_saves is True


def test_engine_config_model_key_overrides_the_served_name() -> None:
    config = ConnectorConfig.from_extra_config({"model": "shared-name"})

    assert config.engine_config(block_size=16, model="served-name").model == "shared-name"
    assert config.engine_config(block_size=16, model="served-name").rank == 0


def test_shared_config_auto_starts_by_default(tmp_path: Any) -> None:
    socket = str(tmp_path / "pool.sock")
    config = ConnectorConfig.from_extra_config(
        {"shared": {"socket": socket, "capacity": "256MiB", "timeout_s": 1.5}}
    )

    shared = config.shared_config()

    assert shared.auto_start is True
    assert shared.socket == socket
    assert shared.capacity == 256 << 20
    assert shared.timeout_s == 1.5


def test_shared_config_auto_start_can_be_turned_off() -> None:
    config = ConnectorConfig.from_extra_config({"shared": {"auto_start": False}})

    assert config.shared_config().auto_start is False


def test_mooncake_keys_and_the_pure_client(clean_mooncake_env: pytest.MonkeyPatch) -> None:
    clean_mooncake_env.setenv("KVFLOW_MOONCAKE_MASTER_SERVER_ADDRESS", "10.9.9.9:1")  # unused
    config = ConnectorConfig.from_extra_config(
        {
            "store": "mooncake",
            "mooncake": {
                "master_server_address": MASTER,
                "global_segment_size": "64MiB",
                "key_prefix": "test/",
                "replica_num": 2,
            },
        }
    )

    worker = config.mooncake_config(pure_client=False)
    scheduler = config.mooncake_config(pure_client=True)

    assert worker.master_server_address == MASTER
    assert worker.global_segment_size == 64 << 20
    assert scheduler.global_segment_size == 0
    for f in dataclasses.fields(worker):
        if f.name != "global_segment_size":
            assert getattr(scheduler, f.name) == getattr(worker, f.name), f.name
    assert scheduler.key_prefix == "test/"
    assert scheduler.replica_num == 2


def test_mooncake_from_the_environment(clean_mooncake_env: pytest.MonkeyPatch) -> None:
    clean_mooncake_env.setenv("KVFLOW_MOONCAKE_MASTER_SERVER_ADDRESS", "10.0.0.1:50051")
    clean_mooncake_env.setenv("KVFLOW_MOONCAKE_GLOBAL_SEGMENT_SIZE", "2GiB")
    clean_mooncake_env.setenv("KVFLOW_MOONCAKE_KEY_PREFIX", "env/")
    config = ConnectorConfig.from_extra_config({"store": "mooncake"})

    worker = config.mooncake_config(pure_client=False)
    scheduler = config.mooncake_config(pure_client=True)

    assert worker.master_server_address == "10.0.0.1:50051"
    assert worker.global_segment_size == 2 << 30
    assert worker.key_prefix == "env/"
    assert scheduler.master_server_address == "10.0.0.1:50051"
    assert scheduler.global_segment_size == 0
    assert scheduler.key_prefix == "env/"


def test_mooncake_without_keys_or_environment_is_refused_when_used(
    clean_mooncake_env: pytest.MonkeyPatch,
) -> None:
    config = ConnectorConfig.from_extra_config({"store": "mooncake"})

    with pytest.raises(ConfigError) as info:
        config.mooncake_config(pure_client=True)

    assert info.value.argument == "master_server_address"


MEMCACHE = {"meta_service_url": "tcp://10.0.0.2:5000", "config_store_url": "tcp://10.0.0.2:6000"}


@pytest.mark.parametrize(
    ("memcache", "inner"),
    [
        ({**MEMCACHE, "protocol": "udp"}, "memcache.protocol"),
        ({**MEMCACHE, "max_copy_batch": 0}, "memcache.max_copy_batch"),
        ({**MEMCACHE, "bogus": 1}, "bogus"),
    ],
)
def test_bad_memcache_settings_are_refused_at_once(memcache: dict[str, Any], inner: str) -> None:
    err = config_error({"store": "memcache", "memcache": memcache})

    assert inner in str(err)


def test_memcache_follows_the_kv_caches_device_unless_told() -> None:
    config = ConnectorConfig.from_extra_config({"store": "memcache", "memcache": MEMCACHE})
    npu = config.memcache_config("npu:3")
    assert (npu.device_id, npu.local_memory) == (3, "device")
    assert npu.meta_service_url == MEMCACHE["meta_service_url"]
    host = config.memcache_config("cpu")
    assert (host.device_id, host.local_memory) == (0, "host")
    told = ConnectorConfig.from_extra_config(
        {"store": "memcache", "memcache": {**MEMCACHE, "device_id": 1, "local_memory": "host"}}
    )
    assert (
        told.memcache_config("npu:3").device_id,
        told.memcache_config("npu:3").local_memory,
    ) == (
        1,
        "host",
    )
