"""The import graph of the ``kvflow`` package, read from the sources (every ``import`` and
``from ... import``, also those inside functions and ``TYPE_CHECKING`` blocks): no circles, and
the rules of docs/architecture.md ("Who may import what"). A submodule's import is counted as
an edge to that submodule only, not to its parent packages' ``__init__``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvflow"
NATIVE = {"kvflow._native"}  # the compiled copy loop: a leaf

LEAVES = (
    "kvflow._validate",
    "kvflow.bounded",
    "kvflow.config",
    "kvflow.cpus",
    "kvflow.errors",
    "kvflow.fields",
    "kvflow.keys",
    "kvflow.kinds",
    "kvflow.layout",
    "kvflow.results",
    "kvflow.stats",
    "kvflow.trace",
)
# the floors, bottom up: a module imports its own floor and those below, never one above
FLOORS = (
    ("data", LEAVES),
    ("copy", ("kvflow.copying", "kvflow._native", "kvflow.cuda")),  # cuda: a former name
    ("stores", ("kvflow.stores", "kvflow.pool")),
    ("devices", ("kvflow.devices", "kvflow.abc", "kvflow.testing")),
    ("pipeline", ("kvflow.pipeline",)),
    ("integrations", ("kvflow.integrations", "kvflow.bench", "kvflow.cli", "kvflow.__main__")),
)
BACKENDS = ("kvflow.stores.local", "kvflow.stores.mooncake", "kvflow.stores.memcache")
# (importers, modules they must not import, why)
RULES = [
    (LEAVES, ("kvflow.",), "the leaves import nothing of kvflow but other leaves"),
    (
        ("kvflow.stores",),
        ("kvflow.pool", "kvflow.pipeline", "kvflow.integrations", "kvflow.bench", "kvflow.cli",
         "kvflow.devices", "kvflow.abc", "kvflow.testing"),
        "a store knows the Store interface and the leaves, nothing that drives it",
    ),
    (
        ("kvflow.pool",),
        ("kvflow.pipeline", "kvflow.integrations", "kvflow.bench"),
        "the pool server and its client store are a backend: stores, never the engine",
    ),
    (
        ("kvflow.pipeline",),
        ("kvflow.pool", "kvflow.integrations", "kvflow.bench", "kvflow.testing", *BACKENDS),
        "the engine moves bytes through any Store and names no backend",
    ),
]  # fmt: skip


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in paths or sub in NATIVE else base)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


GRAPH = _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_every_module() -> None:
    assert len(GRAPH) > 50
    assert "kvflow.pipeline.runtime" in GRAPH["kvflow.pipeline.engine"]
    assert "kvflow.stores.base" in GRAPH["kvflow.pool.service"]


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _floor(name: str) -> int:
    """The floor ``name`` stands on (the package's top level: above every floor)."""
    if name == "kvflow":
        return len(FLOORS)
    on = [i for i, (_, prefixes) in enumerate(FLOORS) if _within(name, prefixes)]
    assert len(on) == 1, f"{name} stands on {len(on)} floors: place it in FLOORS"
    return on[0]


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_every_module_stands_on_one_floor() -> None:
    for name in GRAPH:
        _floor(name)


def test_no_import_goes_up_a_floor() -> None:
    """data -> copy -> stores -> devices -> pipeline -> integrations (docs/architecture.md)."""
    up = sorted(
        f"{m} ({FLOORS[_floor(m)][0]}) -> {t} ({FLOORS[_floor(t)][0]})"
        for m, targets in GRAPH.items()
        for t in targets
        if _floor(t) > _floor(m)
    )
    assert up == []


@pytest.mark.parametrize(("importers", "forbidden", "why"), RULES, ids=lambda r: str(r)[:40])
def test_who_may_import_what(
    importers: tuple[str, ...], forbidden: tuple[str, ...], why: str
) -> None:
    def within(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p.rstrip(".") or name.startswith(p.rstrip(".") + ".") for p in prefixes)

    broken = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        if within(m, importers)
        for t in targets
        if within(t, forbidden) and not (importers == LEAVES and within(t, LEAVES))
    )
    assert broken == [], why


def test_only_the_package_itself_imports_its_top_level() -> None:
    """``from kvflow import X`` inside kvflow would run the whole public namespace's imports
    first; modules import what they use from where it lives."""
    assert sorted(m for m, t in GRAPH.items() if "kvflow" in t and m != "kvflow") == []


def test_only_integrations_and_the_cli_reach_integrations_and_bench() -> None:
    outside = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if (t.startswith("kvflow.integrations") and not m.startswith("kvflow.integrations"))
        or (t.startswith("kvflow.bench") and not m.startswith(("kvflow.bench", "kvflow.cli")))
    )
    assert outside == []


MAX_LINES = 400  # docs/architecture.md: every module one concept, under this many lines


def test_no_module_is_over_the_line_limit() -> None:
    long = {
        _module_name(path): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by concept: {long}"
