"""Each ``kvflow bench`` scenario, run tiny through the CLI: the JSON keeps its fixed keys and
its values are sane."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvflow.cli import main
from kvflow.stores.copyloop import NATIVE


def bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    path = tmp_path / f"{argv[0]}.json"
    assert main(["bench", *argv, "--json", str(path)]) == 0
    result: dict[str, Any] = json.loads(path.read_text())
    assert result["machine"]["cpus"] >= 1
    return result


def test_copy(tmp_path: Path) -> None:
    result = bench(tmp_path, "copy", "--bytes", "1MiB", "--repeats", "1", "--blocks", "4KiB,64KiB")
    assert result["memcpy_gbps"] > 0
    rows = result["rows"]
    keys = {"block_bytes", "threads", "pinned", "coalesced", "gbps", "ratio_to_memcpy"}
    assert all(
        keys <= row.keys() and row["gbps"] > 0 and row["ratio_to_memcpy"] > 0 for row in rows
    )
    assert {r["block_bytes"] for r in rows} == {4096, 65536}
    native = {(r["threads"], r["pinned"], r["coalesced"]) for r in rows if r["loop"] == "native"}
    variants = {(t, p, c) for t in (1, 2) for p in (False, True) for c in (False, True)}
    assert native == (variants if NATIVE else set())
    assert {r["direction"] for r in rows} == {"to_pool", "from_pool"}
    assert any(r["loop"] == "python" for r in rows)


def test_addrgen(tmp_path: Path) -> None:
    result = bench(
        tmp_path, "addrgen", "--blocks", "256", "--block-bytes", "4KiB", "--repeats", "1"
    )
    rows = result["rows"]
    assert len(rows) == 2  # block ids in order, and random
    for row in rows:
        assert row["blocks"] == 256
        assert 0 < row["vectorized_us_per_layer"] < row["python_us_per_layer"]
        assert row["speedup"] > 1
        assert row["share_of_copy_time"] > 0


def test_metadata(tmp_path: Path) -> None:
    result = bench(tmp_path, "metadata", "--layers", "2,4,8", "--tokens", "512,1024")
    rows = result["rows"]
    assert len(rows) == 6
    assert {r["kvflow_calls_per_request"] for r in rows} == {5}  # constant in the layer count
    assert result["kvflow_calls_constant_in_layers"] and result["keys_layers_times_fewer"]
    for r in rows:
        assert r["kvflow_keys_per_request"] == r["chunks"] == r["tokens"] // 16 // 16
        assert r["per_layer_keys_per_request"] == r["layers"] * r["blocks"]
        assert r["per_layer_calls_per_request"] > r["kvflow_calls_per_request"]


def test_overhead(tmp_path: Path) -> None:
    result = bench(tmp_path, "overhead", "--requests", "1,4", "--layers", "4", "--steps", "2")
    rows = result["rows"]
    assert {(r["api"], r["requests"], r["op"]) for r in rows} == {
        (api, n, op) for api in ("async", "sync") for n in (1, 4) for op in ("load", "save")
    }
    for r in rows:
        assert r["us_per_layer_step"] > 0
        assert abs(r["us_per_layer_request"] * r["requests"] - r["us_per_layer_step"]) < 0.1
