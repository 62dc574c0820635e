"""The docs describe the package as it is: the architecture page's tree and the example's usage."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tree_entries(text: str) -> set[str]:
    """The paths the first fenced ``kvflow/`` tree of ``text`` names, relative to the package."""
    block = re.search(r"```\nkvflow/\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no kvflow/ tree"
    entries: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders above this line
    for line in block.group(1).splitlines():
        indent = len(line) - len(line.lstrip())
        first = line.split()[0] if line.strip() else ""
        if not first or indent == 0:
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        prefix = folders[-1][1] if folders else ""
        if first.endswith("/"):
            folders.append((indent, prefix + first))
            entries.add(prefix + first)
            continue
        for name in line.strip().split("  ")[0].split(","):  # "a.py, b.py  what they do"
            if re.fullmatch(r"[\w.]+\.(py|c)", name.strip()):  # not a description's next line
                entries.add(prefix + name.strip())
    return entries


def test_architecture_tree_names_every_module() -> None:
    listed = tree_entries((ROOT / "docs" / "architecture.md").read_text())
    package = ROOT / "kvflow"
    missing = []
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package).as_posix()
        subpackage_init = path.name == "__init__.py" and rel != "__init__.py"
        if path.suffix not in (".py", ".c") or subpackage_init:
            continue
        folder = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
        if folder == "bench/":  # the benchmarks are listed as one folder with their scenarios
            continue
        if rel not in listed:
            missing.append(rel)
    assert not missing, f"docs/architecture.md's tree does not list {missing}"
    stale = sorted(e for e in listed if not (package / e.rstrip("/")).exists())
    assert not stale, f"docs/architecture.md's tree lists what does not exist: {stale}"


def test_example_usage_line_shows_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "examples" / "layerwise_roundtrip.py"
    spec = importlib.util.spec_from_file_location("layerwise_roundtrip", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(path)])
    defaults = vars(module.parse())
    shown = re.findall(r"\[--([\w-]+) ([^\]]+)\]", module.__doc__)
    assert shown, "the example's docstring shows no usage line"
    for option, value in shown:
        default = defaults[option.replace("-", "_")]
        if value.isupper():  # a placeholder such as SIZE: no default to show
            continue
        assert str(default) == value, (
            f"--{option}: the docstring shows {value}, the default is {default}"
        )
