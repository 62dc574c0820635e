"""MooncakeConfig: validation with typed errors, and the three ways to build one. Also: kvflow
imports without Mooncake, and choosing MooncakeStore then says what to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvflow
from kvflow.stores.mooncake.config import MooncakeConfig

MASTER = "10.0.0.1:50051"


def test_defaults() -> None:
    cfg = MooncakeConfig(master_server_address=MASTER)
    assert cfg.metadata_server == "P2PHANDSHAKE"
    assert cfg.protocol == "tcp"
    assert cfg.global_segment_size == 1 << 30
    assert cfg.local_buffer_size == 16 << 20
    assert cfg.replica_num == 1 and cfg.prefer_local_segment
    assert cfg.local_reads and cfg.local_read_window_s == 1.0
    assert cfg.local_hostname  # this host's name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("master_server_address", ""),
        ("master_server_address", "10.0.0.1"),
        ("master_server_address", "10.0.0.1:0"),
        ("master_server_address", "10.0.0.1:http"),
        ("protocol", "udp"),
        ("metadata_server", ""),
        ("global_segment_size", "1MiB"),  # Mooncake refuses segments under 16 MiB
        ("global_segment_size", -1),
        ("global_segment_size", "lots"),
        ("local_buffer_size", -5),
        ("replica_num", 0),
        ("replica_num", True),
        ("replica_num", 1.5),
        ("timeout_s", 0),
        ("timeout_s", float("nan")),
        ("prefer_local_segment", "yes"),
        ("local_reads", 1),
        ("local_read_window_s", 0),
        ("local_read_window_s", "1s"),
        ("key_prefix", 3),
    ],
)
def test_bad_values_are_config_errors_naming_the_field(field: str, value: object) -> None:
    values: dict[str, object] = {"master_server_address": MASTER, field: value}
    with pytest.raises(kvflow.ConfigError) as err:
        MooncakeConfig(**values)  # type: ignore[arg-type]
    assert field in str(err.value)


def test_sizes_accept_units_and_zero_makes_a_pure_client() -> None:
    cfg = MooncakeConfig(master_server_address=MASTER, global_segment_size=0)
    assert cfg.global_segment_size == 0
    cfg = MooncakeConfig(master_server_address=MASTER, global_segment_size="4GiB")
    assert cfg.global_segment_size == 4 << 30


def test_from_dict_refuses_unknown_keys_and_lists_the_known_ones() -> None:
    with pytest.raises(kvflow.ConfigError) as err:
        MooncakeConfig.from_dict({"master_server_address": MASTER, "master": "x"})
    assert "master" in str(err.value) and "replica_num" in str(err.value)


def test_from_json(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": MASTER, "protocol": "rdma"}))
    cfg = MooncakeConfig.from_json(path)
    assert (cfg.master_server_address, cfg.protocol) == (MASTER, "rdma")
    path.write_text("[1, 2]")
    with pytest.raises(kvflow.ConfigError, match="one object"):
        MooncakeConfig.from_json(path)
    with pytest.raises(kvflow.ConfigError, match="cannot read"):
        MooncakeConfig.from_json(tmp_path / "absent.json")


def test_from_env_reads_the_json_file_then_variables_on_top(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": MASTER, "replica_num": 2}))
    cfg = MooncakeConfig.from_env(
        {
            "MOONCAKE_CONFIG_PATH": str(path),
            "KVFLOW_MOONCAKE_REPLICA_NUM": "3",
            "KVFLOW_MOONCAKE_GLOBAL_SEGMENT_SIZE": "2GiB",
            "KVFLOW_MOONCAKE_PREFER_LOCAL_SEGMENT": "0",
            "KVFLOW_MOONCAKE_TIMEOUT_S": "2.5",
            "KVFLOW_MOONCAKE_LOCAL_READS": "no",
            "KVFLOW_MOONCAKE_LOCAL_READ_WINDOW_S": "0.5",
        }
    )
    assert cfg.master_server_address == MASTER
    assert (cfg.replica_num, cfg.global_segment_size) == (3, 2 << 30)
    assert (cfg.prefer_local_segment, cfg.timeout_s) == (False, 2.5)
    assert (cfg.local_reads, cfg.local_read_window_s) == (False, 0.5)
    bad = [("REPLICA_NUM", "two"), ("TIMEOUT_S", "soon"), ("PREFER_LOCAL_SEGMENT", "?")]
    bad += [("LOCAL_READS", "maybe"), ("LOCAL_READ_WINDOW_S", "later")]
    for name, raw in bad:
        env = {"KVFLOW_MOONCAKE_MASTER_SERVER_ADDRESS": MASTER, f"KVFLOW_MOONCAKE_{name}": raw}
        with pytest.raises(kvflow.ConfigError, match=name):
            MooncakeConfig.from_env(env)


def test_store_takes_a_config_or_options_not_both() -> None:
    with pytest.raises(kvflow.InvalidArgumentError, match="options"):
        kvflow.MooncakeStore(MooncakeConfig(master_server_address=MASTER), replica_num=2)


def test_kvflow_imports_without_mooncake_and_names_the_extra() -> None:
    """In a process where ``mooncake`` cannot be imported."""
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.store'] = None\n"
        "import kvflow\n"
        "try:\n"
        "    kvflow.MooncakeStore(master_server_address='127.0.0.1:50051')\n"
        "except kvflow.MissingDependencyError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "MissingDependencyError" in out.stdout
    assert "kvflow[mooncake]" in out.stdout
