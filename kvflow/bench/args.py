"""The scenarios' options and numbers: argparse types (counts, fractions, sizes, lists),
defaults for ``--quick``, output paths checked before a run, and byte sizes for tables."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvflow.config import parse_size
from kvflow.errors import ConfigError

__all__ = [
    "KiB",
    "MiB",
    "check_output_path",
    "count",
    "fmt_bytes",
    "fraction",
    "int_list",
    "pick",
    "size_arg",
    "size_list",
]

KiB = 1 << 10
MiB = 1 << 20


def count(text: str) -> int:
    """``"16"`` -> ``16``: an integer >= 1 (argparse ``type``)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def fraction(text: str) -> float:
    """``"0.9"`` -> ``0.9``: a number strictly between 0 and 1 (argparse ``type``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def size_arg(text: str) -> int:
    """``"64MiB"`` -> ``67108864`` (argparse ``type``)."""
    try:
        return parse_size(text.strip(), argument="size")
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 64MiB or 4096, got {text!r}"
        ) from None


def size_list(text: str) -> list[int]:
    """``"4KiB,1MiB"`` -> ``[4096, 1048576]`` (argparse ``type``)."""
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    try:
        if sizes:
            return [parse_size(s, argument="size") for s in sizes]
    except ConfigError:
        pass
    raise argparse.ArgumentTypeError(
        f"expected comma-separated sizes such as 4KiB,1MiB, got {text!r}"
    )


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: integers >= 1 (argparse ``type``)."""
    values = [s.strip() for s in text.split(",") if s.strip()]
    if not values or not all(v.isdigit() and int(v) >= 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 such as 1,2,4, got {text!r}"
        )
    return [int(v) for v in values]


def check_output_path(path: str, option: str) -> None:
    """Before a run, refuse an output file (``--json``, ``--plot``) that could not be written
    after it: its folder is created, as writing it would, and must be writable, and the path
    must not be a folder. Raises ConfigError naming ``option``."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocked = isinstance(exc, (FileExistsError, NotADirectoryError))
        why = "a file is in the way" if blocked else exc.strerror
        raise ConfigError(
            option, path, f"cannot create its folder {target.parent}: {why}"
        ) from None
    if target.is_dir():
        raise ConfigError(option, path, "is a folder; give a file name")
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        raise ConfigError(option, path, "cannot be written (permissions or a read-only folder)")


def pick(value: Any, quick: bool, full: Any, small: Any) -> Any:
    """An option's value if given, else the quick or the full default."""
    if value is not None:
        return value
    return small if quick else full


def fmt_bytes(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"
