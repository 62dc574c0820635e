"""Config fields: one way for every kvflow config to declare, convert and check its fields.

A config subclasses ``Config`` and declares each field with its kind::

    class EngineConfig(Config):
        chunk_blocks: int = count(default=4)               # an int >= 1 (``low=``, ``high=``)
        max_transfer_bytes: int | str = size(default="64MiB", low=1)   # "8GiB", held as int
        copy_timeout_s: float = seconds(default=10.0)      # a finite float > 0

The kinds (``size``, ``seconds``, ``count``, ``cpus``, ``uids``, ``choice``, ``flag``,
``text``, ``path``, ``settings``), their ``check`` and ``also``, and ``parse_size`` live in
``kvflow.kinds``; this module re-exports them, so a config imports all it needs from here.

A subclass of ``Config`` is a frozen dataclass whose generated ``__init__`` is wrapped: every
argument, given or default, is converted by its kind before the frozen instance is built, so an
instance only holds converted values (a size as an int, CPUs as a tuple, seconds as a float).
``__post_init__`` is left for checks across fields; it changes nothing. ``dataclasses.replace``
and ``fields`` work as on any dataclass, and ``replace`` builds through the same ``__init__``,
so it converts and checks again. Every refusal is ``ConfigError(field, value, reason)``.
``Config.from_dict`` refuses unknown keys, naming them and listing the known ones;
``env_values`` reads ``<PREFIX><FIELD>`` variables, each parsed from its text by the field's
kind, and its refusals name the variable.

An annotation says what the constructor accepts, for type checkers (which apply no converter):
a size is ``int | str`` though an instance holds an int.

Why no library: attrs classes are not dataclasses (``dataclasses.replace`` and ``fields``,
which kvflow and its users call on configs, refuse them), and pydantic (a compiled core and
three more packages) reports a list of errors in its own type that would be translated back
into ``ConfigError``; neither would make this module much smaller. The standard library's
dataclasses with one wrapped ``__init__`` do all of it.

A leaf: imports nothing of kvflow but ``kvflow.errors`` and ``kvflow.kinds``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from kvflow.errors import ConfigError
from kvflow.kinds import (
    Kind,
    as_seconds,
    choice,
    count,
    cpus,
    flag,
    kind_of,
    parse_size,
    path,
    seconds,
    settings,
    size,
    text,
    uids,
)

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # only type checkers read it

    def dataclass_transform(**_: object) -> Callable[[type], type]:
        return lambda cls: cls


__all__ = [
    "Config",
    "Kind",
    "as_seconds",
    "choice",
    "count",
    "cpus",
    "env_values",
    "flag",
    "from_dict",
    "parse_size",
    "path",
    "seconds",
    "settings",
    "size",
    "text",
    "uids",
]

C = TypeVar("C")
K = TypeVar("K", bound="Config")


@dataclass_transform(
    frozen_default=True,
    field_specifiers=(size, seconds, count, cpus, uids, choice, flag, text, path, settings),
)
class Config:
    """Base of kvflow's configs: each subclass is a frozen dataclass whose fields are declared
    with a kind (see the module docstring) and converted by it on construction."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        specs = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        undeclared = [f.name for f in specs if kind_of(f) is None]
        if undeclared:
            raise TypeError(f"{cls.__name__}: declare the kind of {undeclared} (kvflow.fields)")
        kinds = [(f, kind) for f in specs if (kind := kind_of(f)) is not None]
        setattr(cls, "__init__", _converting(cls.__init__, kinds))  # noqa: B010

    @classmethod
    def from_dict(cls: type[K], values: Mapping[str, Any]) -> K:
        """From a plain dict of field values; unknown keys are an error that lists the known
        ones."""
        return from_dict(cls, values)


def _converting(
    init: Callable[..., None], kinds: list[tuple[dataclasses.Field[Any], Kind]]
) -> Callable[..., None]:
    """``init`` (a dataclass's generated ``__init__``), called with every field converted by
    its kind: the values given, and the defaults of the others."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: object, *args: Any, **kwargs: Any) -> None:
        try:
            given = signature.bind(self, *args, **kwargs).arguments
        except TypeError as exc:  # as the dataclass's own __init__ says it
            raise TypeError(f"{init.__qualname__}() {exc}") from None
        values = {f.name: kind(f.name, _value(f, given)) for f, kind in kinds}
        init(self, **values)

    return __init__


def _value(spec: dataclasses.Field[Any], given: Mapping[str, Any]) -> Any:
    if spec.name in given:
        return given[spec.name]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default  # every field has one or the other, or ``bind`` refused the call


def from_dict(cls: type[C], values: Mapping[str, Any]) -> C:
    """The config dataclass ``cls`` from a plain dict; unknown keys are a ConfigError that
    lists the known ones (``cls`` converts and checks each value itself)."""
    if not isinstance(values, Mapping):
        raise ConfigError("config", values, "must be an object of settings")
    known = sorted(f.name for f in dataclasses.fields(cls) if f.init)  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError("config", unknown, f"unknown keys; known keys are {known}")
    return cls(**values)


def env_values(
    cls: type[Config], prefix: str, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The fields of ``cls`` that ``<prefix><FIELD>`` variables set (``os.environ`` by default),
    each parsed from its text and converted by its kind; a refusal names the variable."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
        variable = prefix + spec.name.upper()
        raw, kind = env.get(variable), kind_of(spec)
        if raw is not None and kind is not None and spec.init:
            values[spec.name] = kind.from_text(variable, raw)
    return values
