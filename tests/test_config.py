"""Configuration: sizes such as "8GiB" and EngineConfig's validation of every field."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os

import pytest

import kvflow
from kvflow import ConfigError, EngineConfig, InvalidArgumentError
from kvflow.config import DEFAULT_MAX_TRANSFER_BYTES, parse_size

# -- parse_size -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("8GiB", 8 << 30),
        ("512 MiB", 512 << 20),
        ("2GB", 2_000_000_000),
        ("4096", 4096),
        (4096, 4096),
        (0, 0),
        ("0", 0),
        ("  1 KiB  ", 1024),
        ("1.5KiB", 1536),
        ("0.5 GiB", 1 << 29),
        ("8gib", 8 << 30),
        ("8GIB", 8 << 30),
        ("3k", 3000),
        ("3kb", 3000),
        ("7m", 7_000_000),
        ("1T", 10**12),
        ("1TiB", 1 << 40),
        ("7b", 7),
        ("7B", 7),
        (1 << 50, 1 << 50),
    ],
)
def test_parse_size_reads_byte_counts_and_units(given: int | str, expected: int) -> None:
    result = parse_size(given)

    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "given",
    [
        *("", "  ", "abc", "GiB", "8 GiBs", "8XB", "8 gibibytes", "1e3", "-5MiB", "8.GiB"),
        *("1,024", "0x10", "+5", "5 5", "inf", "nan"),
    ],
)
def test_parse_size_refuses_malformed_strings(given: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(given, argument="capacity")

    assert info.value.argument == "capacity"
    assert info.value.value == given
    assert f"capacity={given!r}" in str(info.value)


@pytest.mark.parametrize("given", [-1, -(1 << 40)])
def test_parse_size_refuses_negative_ints(given: int) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(given)

    assert info.value.argument == "size"
    assert "negative" in str(info.value)


@pytest.mark.parametrize("given", ["1.5", "0.1KiB", "1.0000001MB", "0.3B"])
def test_parse_size_refuses_sizes_that_are_not_whole_bytes(given: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(given)

    assert info.value.argument == "size"
    assert "whole number of bytes" in str(info.value)


def test_parse_size_refuses_sizes_too_large_to_represent() -> None:
    with pytest.raises(ConfigError) as info:
        parse_size("9" * 400 + "TiB")

    assert info.value.argument == "size"


@pytest.mark.parametrize("given", [True, False, 1.5, 4096.0, None, [1], b"8GiB"])
def test_parse_size_refuses_other_types(given: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(given)  # type: ignore[arg-type]

    assert info.value.argument == "size"
    assert info.value.value is given


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("4.1GB", 4_100_000_000),
        ("1.001KB", 1001),
        ("9007199254740993", 2**53 + 1),
        ("9007199254740993B", 2**53 + 1),
    ],
)
def test_parse_size_is_exact_for_whole_byte_sizes(given: str, expected: int) -> None:
    assert parse_size(given) == expected


def test_config_errors_are_invalid_argument_errors() -> None:
    with pytest.raises(InvalidArgumentError):
        parse_size("nope")


# -- EngineConfig -----------------------------------------------------------------------------


def test_engine_config_defaults_are_valid() -> None:
    config = EngineConfig()

    assert config.model == "default"
    assert config.rank == 0
    assert config.copy_cpus == ()
    assert config.max_transfer_bytes == DEFAULT_MAX_TRANSFER_BYTES
    assert config.transfer_limit == DEFAULT_MAX_TRANSFER_BYTES


@pytest.mark.parametrize(
    ("given", "expected"), [("64MiB", 64 << 20), ("1 KB", 1000), (4096, 4096), ("1", 1)]
)
def test_max_transfer_bytes_accepts_sizes_and_normalises_to_int(
    given: int | str, expected: int
) -> None:
    config = EngineConfig(max_transfer_bytes=given)

    assert config.max_transfer_bytes == expected
    assert type(config.max_transfer_bytes) is int
    assert config.transfer_limit == expected


def test_configs_with_equal_sizes_written_differently_are_equal() -> None:
    assert EngineConfig(max_transfer_bytes="64MiB") == EngineConfig(max_transfer_bytes=64 << 20)


def test_engine_config_is_frozen() -> None:
    config = EngineConfig()

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 1  # type: ignore[misc]


def test_engine_config_accepts_valid_values() -> None:
    cpu = min(os.sched_getaffinity(0))

    config = EngineConfig(
        model="org/model",
        rank=3,
        chunk_blocks=1,
        prefetch_layers=1,
        save_backlog=1,
        copy_threads=2,
        copy_cpus=[cpu],  # type: ignore[arg-type]
        max_transfer_bytes="1MiB",
        copy_timeout_s=0.5,
        op_timeout_s=2,
    )

    assert config.rank == 3
    assert config.copy_cpus == (cpu,)
    assert config.op_timeout_s == 2
    assert config.copy_timeout_s == 0.5


_BAD_VALUES: list[tuple[str, object]] = [
    ("model", ""),
    ("model", "   "),
    ("model", 5),
    ("model", None),
    ("rank", -1),
    ("rank", True),
    ("rank", 1.0),
    ("rank", "0"),
    ("copy_cpus", "0"),
    ("copy_cpus", 3),
    ("copy_cpus", None),
    ("copy_cpus", (-1,)),
    ("copy_cpus", (True,)),
    ("copy_cpus", (0.0,)),
    ("copy_cpus", ("0",)),
    ("max_transfer_bytes", 0),
    ("max_transfer_bytes", "0"),
    ("max_transfer_bytes", "0 MiB"),
    ("max_transfer_bytes", -1),
    ("max_transfer_bytes", "lots"),
    ("max_transfer_bytes", 1.5),
    ("max_transfer_bytes", True),
    ("max_transfer_bytes", None),
]
for _name in ("chunk_blocks", "prefetch_layers", "save_backlog", "copy_threads"):
    _BAD_VALUES += [(_name, v) for v in (0, -1, True, 2.0, "4", None)]
for _name in ("copy_timeout_s", "op_timeout_s"):
    _BAD_VALUES += [(_name, v) for v in (0, -1, -0.5, math.nan, math.inf, True, "1", None)]
for _name in ("inline_saves", "deferred_saves"):
    _BAD_VALUES += [(_name, v) for v in (1, "yes", None, 0.0)]


@pytest.mark.parametrize(("field", "value"), _BAD_VALUES)
def test_engine_config_refuses_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})  # type: ignore[arg-type]

    assert info.value.argument == field
    assert str(info.value).startswith(f"{field}=")


def test_every_field_is_validated() -> None:
    refused = {field for field, _ in _BAD_VALUES}

    assert refused == {f.name for f in dataclasses.fields(EngineConfig)}


def test_copy_cpus_refuses_a_cpu_that_is_not_online() -> None:
    available = os.sched_getaffinity(0)
    missing = max(max(available), os.cpu_count() or 1) + 1

    with pytest.raises(ConfigError) as info:
        EngineConfig(copy_cpus=(min(available), missing))

    assert info.value.argument == "copy_cpus"
    assert f"[{missing}]" in str(info.value)
    assert "not online" in str(info.value)


def test_copy_cpus_may_name_an_online_cpu_outside_the_process_affinity() -> None:
    """An inference server binds its worker to the compute cores; the copy thread goes to
    another core, which the worker's own affinity no longer lists."""
    online = os.cpu_count() or 1
    if online < 2:
        pytest.skip("needs two CPUs")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        assert EngineConfig(copy_cpus=(online - 1,)).copy_cpus == (online - 1,)
    finally:
        os.sched_setaffinity(0, before)


def test_copy_cpus_accepts_every_available_cpu_as_a_tuple() -> None:
    available = sorted(os.sched_getaffinity(0))

    config = EngineConfig(copy_cpus=iter(available))  # type: ignore[arg-type]

    assert config.copy_cpus == tuple(available)


# -- EngineConfig.from_dict -------------------------------------------------------------------


def test_from_dict_builds_a_config() -> None:
    cpu = min(os.sched_getaffinity(0))

    config = EngineConfig.from_dict(
        {"model": "m", "rank": 2, "copy_cpus": [cpu], "max_transfer_bytes": "64MiB"}
    )

    assert config == EngineConfig(model="m", rank=2, copy_cpus=(cpu,), max_transfer_bytes=64 << 20)
    assert config.copy_cpus == (cpu,)


def test_from_dict_of_nothing_is_the_default_config() -> None:
    assert EngineConfig.from_dict({}) == EngineConfig()


def test_from_dict_refuses_unknown_keys_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"model": "m", "chunk_size": 4, "threads": 2})

    assert info.value.argument == "config"
    assert info.value.value == ["chunk_size", "threads"]
    message = str(info.value)
    for field in dataclasses.fields(EngineConfig):
        assert repr(field.name) in message


def test_from_dict_validates_values_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"copy_cpus": None})

    assert info.value.argument == "copy_cpus"

    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"save_backlog": 0})

    assert info.value.argument == "save_backlog"


# -- the package's version --------------------------------------------------------------------


def test_version_is_the_installed_distribution_s() -> None:
    """One source: pyproject.toml's version, as installed."""
    assert kvflow.__version__ == importlib.metadata.version("kvflow")
