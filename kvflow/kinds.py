"""The kinds of config fields: how each kind of value is converted, checked and read from text.

A kind function declares a field of a ``kvflow.fields.Config``: ``size`` (bytes, "8GiB"
through ``parse_size``), ``seconds``, ``count``, ``cpus`` and ``uids`` (tuples of integers
>= 0), ``choice`` (one of a tuple), ``flag`` (a bool), ``text``, ``path`` and ``settings`` (a
mapping of a nested config's keys). Each takes ``check``, a function of the converted value
that returns a reason to refuse it (or None), and ``also``, values accepted as they are besides
the kind's own (``(None,)`` makes a field optional).

Each returns a ``dataclasses.field`` whose metadata holds its ``Kind`` (``kind_of`` reads it):
``convert`` turns a given value into the one to hold, ``parse`` an environment variable's text
into a value for ``convert``. Every refusal is ``ConfigError(field, value, reason)``.

A leaf: imports nothing of kvflow but ``kvflow.errors``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any

from kvflow.errors import ConfigError

__all__ = [
    "Kind",
    "as_seconds",
    "choice",
    "count",
    "cpus",
    "flag",
    "kind_of",
    "parse_size",
    "path",
    "seconds",
    "settings",
    "size",
    "text",
    "uids",
]

Check = Callable[[Any], "str | None"]  # the reason to refuse a converted value, or None
Also = tuple[object, ...]  # values a field accepts as they are, besides its kind's
_KIND = "kvflow.kind"  # the key of a field's Kind in its metadata

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def parse_size(value: int | str, *, argument: str = "size") -> int:
    """Bytes from an int or a string such as ``"8GiB"``, ``"512 MiB"``, ``"2GB"`` or ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers
    of 1000. Raises ConfigError naming ``argument`` for anything else, or a negative size.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(argument, value, "expected a byte count or a size such as '8GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(argument, value, "must not be negative")
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            argument, value, "expected a size such as '8GiB', '512MiB', '2GB' or '4096'"
        )
    size = Fraction(match.group(1)) * _UNITS[unit]
    if size.denominator != 1:
        raise ConfigError(argument, value, "is not a whole number of bytes")
    if size >= 1 << 63:
        raise ConfigError(argument, value, "is too large (at most 2**63 - 1 bytes)")
    return int(size)


def as_seconds(name: str, value: Any) -> float:
    """The ``seconds`` kind's conversion: a finite number > 0, as a float (ConfigError naming
    ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(name, value, "must be a number of seconds > 0")
    if not math.isfinite(value):
        raise ConfigError(name, value, "must be finite")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Kind:
    """How a field's value is converted: ``convert(name, value)`` returns the value to hold or
    raises ConfigError; ``parse(text)`` reads an environment variable's text into a value for
    ``convert``, raising ValueError (refused with ``text_reason``) when it cannot."""

    convert: Callable[[str, Any], Any]
    parse: Callable[[str], Any] = str
    text_reason: str = ""
    check: Check | None = None
    also: Also = ()

    def __call__(self, name: str, value: Any) -> Any:
        """``value`` converted and checked; a ConfigError names ``name`` and ``value``."""
        if _among(value, self.also):
            return value
        converted = self.convert(name, value)
        reason = self.check(converted) if self.check else None
        if reason:
            raise ConfigError(name, value, reason)
        return converted

    def from_text(self, name: str, raw: str) -> Any:
        """An environment variable's text, converted as ``__call__`` does."""
        if _among(raw, self.also):
            return raw
        try:
            return self(name, self.parse(raw))
        except ValueError as exc:  # ConfigError too: it shows the converted value, not the text
            reason = exc.reason if isinstance(exc, ConfigError) else self.text_reason
            raise ConfigError(name, raw, reason) from None


def kind_of(spec: dataclasses.Field[Any]) -> Kind | None:
    """The Kind a kind function gave the dataclass field ``spec`` (None: declared otherwise)."""
    kind: Kind | None = spec.metadata.get(_KIND)
    return kind


def _among(value: Any, values: Also) -> bool:
    return any(value is v or (type(value) is type(v) and value == v) for v in values)


def _field(kind: Kind, check: Check | None, also: Also, **default: Any) -> Any:
    kind = dataclasses.replace(kind, check=check, also=also)
    return dataclasses.field(**default, metadata={_KIND: kind})


# -- the kinds --------------------------------------------------------------------------------


def size(
    *,
    default: int | str | None,
    low: int = 0,
    high: int | None = None,
    check: Check | None = None,
    also: Also = (),
) -> Any:
    """Bytes, from an int or a size such as ``"8GiB"`` (``parse_size``), from ``low`` to
    ``high``; held as an int."""

    def convert(name: str, value: Any) -> int:
        n = parse_size(value, argument=name)
        if n < low:
            raise ConfigError(name, value, f"must be at least {_show_bytes(low)}")
        if high is not None and n > high:
            raise ConfigError(name, value, f"must be at most {_show_bytes(high)}")
        return n

    return _field(Kind(convert), check, also, default=default)


def seconds(*, default: float | None, check: Check | None = None, also: Also = ()) -> Any:
    """A finite number of seconds > 0, held as a float."""
    return _field(Kind(as_seconds, float, "must be a number"), check, also, default=default)


def count(
    *,
    default: int | None,
    low: int = 1,
    high: int | None = None,
    check: Check | None = None,
    also: Also = (),
) -> Any:
    """An integer from ``low`` (default 1) to ``high`` (a bool is not one)."""
    reason = f"must be an integer >= {low}"
    if high is not None:
        reason = f"must be an integer from {low} to {high}"

    def convert(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, value, reason)
        if value < low or (high is not None and value > high):
            raise ConfigError(name, value, reason)
        return value

    return _field(Kind(convert, int, "must be an integer"), check, also, default=default)


def _numbers(what: str) -> Kind:
    """A tuple of integers >= 0 (``what`` they are), from any iterable, or "0,1" as text."""

    def convert(name: str, value: Any) -> tuple[int, ...]:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise ConfigError(name, value, f"must be a list of {what}")
        items = tuple(value)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
            raise ConfigError(name, items, f"{what} must be integers >= 0")
        return items

    def parse(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(",") if part.strip())

    return Kind(convert, parse, f"expected {what} such as 0,1")


def cpus(
    *, default: tuple[int, ...] | str | None = (), check: Check | None = None, also: Also = ()
) -> Any:
    """CPU numbers, held as a tuple (empty: no pinning)."""
    return _field(_numbers("CPU numbers"), check, also, default=default)


def uids(
    *, default: tuple[int, ...] | None = (), check: Check | None = None, also: Also = ()
) -> Any:
    """User ids, held as a tuple."""
    return _field(_numbers("user ids"), check, also, default=default)


def choice(
    choices: tuple[str, ...], *, default: str | None, check: Check | None = None, also: Also = ()
) -> Any:
    """One of ``choices``."""

    def convert(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(name, value, f"expected one of {choices}")
        return value

    return _field(Kind(convert), check, also, default=default)


def flag(*, default: bool | None, check: Check | None = None, also: Also = ()) -> Any:
    """A bool (from the environment: 1, 0, true, false, yes, no)."""

    def convert(name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(name, value, "must be true or false")
        return value

    def parse(text: str) -> bool:
        word = text.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(word)
        return word in _TRUE

    return _field(Kind(convert, parse, "must be 1 or 0"), check, also, default=default)


def _text(
    paths: bool, empty: bool, when_empty: Callable[[], str] | None, absolute: bool = False
) -> Kind:
    def convert(name: str, value: Any) -> str:
        if paths and isinstance(value, os.PathLike):
            value = os.fspath(value)
        if value is None and when_empty is not None:  # "not given", as "" is
            value = ""
        if not isinstance(value, str):
            raise ConfigError(name, value, "must be a path" if paths else "must be a string")
        held: str = value if value or when_empty is None else when_empty()
        if not empty and not held.strip():
            raise ConfigError(name, value, "must not be empty")
        return os.path.abspath(held) if absolute and held else held

    return Kind(convert)


def text(
    *,
    default: str | None,
    empty: bool = True,
    when_empty: Callable[[], str] | None = None,
    check: Check | None = None,
    also: Also = (),
) -> Any:
    """A string; ``empty=False`` refuses a blank one; ``when_empty()`` replaces ``""`` and
    None (a value not given)."""
    return _field(_text(False, empty, when_empty), check, also, default=default)


def path(
    *,
    default: str | None,
    absolute: bool = False,
    when_empty: Callable[[], str] | None = None,
    check: Check | None = None,
    also: Also = (),
) -> Any:
    """A file system path (a string or an ``os.PathLike``), held as a string; ``absolute``:
    made absolute (against the working directory when the config is built)."""
    return _field(_text(True, True, when_empty, absolute), check, also, default=default)


def settings(
    *,
    default_factory: Callable[[], Mapping[str, Any]],
    check: Check | None = None,
    also: Also = (),
) -> Any:
    """A mapping of settings (a nested config's keys; a JSON object from the environment)."""

    def convert(name: str, value: Any) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise ConfigError(name, value, "must be an object of settings")
        return value

    kind = Kind(convert, json.loads, "must be a JSON object")
    return _field(kind, check, also, default_factory=default_factory)


def _show_bytes(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} byte" if n == 1 else f"{n} bytes"
