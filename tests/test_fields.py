"""kvflow.fields: every kind converts and refuses with a ConfigError naming the field and value;
a config holds converted values, ``dataclasses.replace`` converts and checks again, dicts and
the environment build configs the same way, and a field without a kind is refused at once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvflow import ConfigError, EngineConfig
from kvflow.fields import (
    Config,
    choice,
    count,
    cpus,
    env_values,
    flag,
    path,
    seconds,
    settings,
    size,
    text,
    uids,
)


def _even(n: int) -> str | None:
    return None if n % 2 == 0 else "must be even"


class Sample(Config):
    capacity: int | str = size(default="1KiB", low=1, high=1 << 20)
    timeout_s: float = seconds(default=1)
    workers: int = count(default=2, check=_even)
    rank: int | None = count(default=None, low=0, also=(None,))
    copy_cpus: tuple[int, ...] | str = cpus(default="auto", also=("auto",))
    allow_uids: tuple[int, ...] = uids(default=())
    mode: str = choice(("a", "b"), default="a")
    on: bool = flag(default=False)
    name: str = text(default="", when_empty=lambda: "filled")
    label: str = text(default="x", empty=False)
    file: str = path(default="")
    where: str = path(default="", absolute=True, when_empty=lambda: "here.sock")
    nested: Mapping[str, Any] = settings(default_factory=dict)


def test_defaults_are_converted_too() -> None:
    sample = Sample()

    assert (sample.capacity, sample.timeout_s, type(sample.timeout_s)) == (1024, 1.0, float)
    assert (sample.rank, sample.copy_cpus, sample.name) == (None, "auto", "filled")
    assert Sample().nested is not sample.nested  # a fresh default each time


def test_values_are_converted_before_the_instance_is_built() -> None:
    sample = Sample(capacity="2KiB", copy_cpus=iter([1, 0]), allow_uids=[7], file=Path("/x"))

    assert (sample.capacity, sample.copy_cpus, sample.allow_uids) == (2048, (1, 0), (7,))
    assert sample.file == "/x"
    assert Sample().where == os.path.abspath("here.sock")
    assert Sample(where="/a/../b").where == "/b"
    assert sample == Sample(capacity=2048, copy_cpus=(1, 0), allow_uids=(7,), file="/x")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("capacity", 0, "at least 1 byte"),
        ("capacity", "2MiB", "at most 1 MiB"),
        ("capacity", "lots", "expected a size"),
        ("timeout_s", 0, "seconds > 0"),
        ("timeout_s", float("inf"), "finite"),
        ("workers", 0, "integer >= 1"),
        ("workers", 3, "must be even"),
        ("workers", True, "integer >= 1"),
        ("rank", -1, "integer >= 0"),
        ("copy_cpus", "0", "list of CPU numbers"),
        ("copy_cpus", [0, -1], "integers >= 0"),
        ("allow_uids", None, "list of user ids"),
        ("mode", "c", "one of ('a', 'b')"),
        ("on", 1, "true or false"),
        ("name", 5, "a string"),
        ("label", "  ", "not be empty"),
        ("file", b"/x", "a path"),
        ("nested", [], "object of settings"),
    ],
)
def test_a_refusal_names_the_field_the_value_and_why(field: str, value: Any, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        Sample(**{field: value})

    assert info.value.argument == field
    assert str(info.value).startswith(f"{field}=")
    assert reason in info.value.reason


def test_a_check_sees_the_converted_value_and_the_error_shows_the_given_one() -> None:
    with pytest.raises(ConfigError) as info:
        Sample(capacity="3", workers=3)

    assert (info.value.argument, info.value.value) == ("workers", 3)


def test_replace_converts_and_checks_again() -> None:
    sample = Sample()

    assert dataclasses.replace(sample, capacity="4KiB").capacity == 4096
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(sample, workers=0)
    assert info.value.argument == "workers"
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.workers = 4  # type: ignore[misc]


def test_positional_and_wrong_arguments_are_as_a_dataclass_takes_them() -> None:
    assert Sample("2KiB", 3).capacity == 2048
    assert EngineConfig("m", 1) == EngineConfig(model="m", rank=1)
    with pytest.raises(TypeError, match=r"Sample.__init__\(\) .*unexpected keyword.*'bogus'"):
        Sample(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values"):
        Sample("1KiB", capacity="2KiB")  # type: ignore[misc]


def test_a_field_without_a_kind_is_refused_when_the_class_is_made() -> None:
    with pytest.raises(TypeError, match=r"declare the kind of \['plain'\]"):

        class Broken(Config):
            plain: int = 3


def test_from_dict_refuses_unknown_keys_and_what_is_not_a_dict() -> None:
    assert Sample.from_dict({"capacity": "2KiB"}).capacity == 2048
    with pytest.raises(ConfigError) as info:
        Sample.from_dict({"capacity": 1, "speed": 2, "colour": 3})
    assert (info.value.argument, info.value.value) == ("config", ["colour", "speed"])
    assert "'workers'" in info.value.reason
    with pytest.raises(ConfigError) as info:
        Sample.from_dict(["capacity"])  # type: ignore[arg-type]
    assert info.value.argument == "config"


def test_env_values_parse_each_kind_from_text() -> None:
    env = {
        "S_CAPACITY": "2KiB",
        "S_TIMEOUT_S": "0.5",
        "S_WORKERS": "4",
        "S_COPY_CPUS": "0, 2",
        "S_MODE": "b",
        "S_ON": "yes",
        "S_NESTED": '{"a": 1}',
        "OTHER_WORKERS": "6",
    }

    values = env_values(Sample, "S_", env)

    assert values == {
        "capacity": 2048,
        "timeout_s": 0.5,
        "workers": 4,
        "copy_cpus": (0, 2),
        "mode": "b",
        "on": True,
        "nested": {"a": 1},
    }
    assert env_values(Sample, "S_", {"S_COPY_CPUS": "auto"}) == {"copy_cpus": "auto"}
    assert Sample(**values).capacity == 2048


@pytest.mark.parametrize(
    ("variable", "raw", "reason"),
    [
        ("S_WORKERS", "two", "an integer"),
        ("S_WORKERS", "3", "must be even"),
        ("S_TIMEOUT_S", "soon", "a number"),
        ("S_ON", "maybe", "1 or 0"),
        ("S_COPY_CPUS", "0-3", "CPU numbers such as 0,1"),
        ("S_CAPACITY", "lots", "expected a size"),
        ("S_NESTED", "{", "JSON object"),
    ],
)
def test_env_refusals_name_the_variable(variable: str, raw: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        env_values(Sample, "S_", {variable: raw})

    assert (info.value.argument, info.value.value) == (variable, raw)
    assert reason in info.value.reason


def test_env_values_read_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_TEST_FIELDS_WORKERS", "8")

    assert env_values(Sample, "KVFLOW_TEST_FIELDS_") == {"workers": 8}
