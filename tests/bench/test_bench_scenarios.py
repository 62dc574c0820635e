"""Each ``kvflow bench`` scenario, run tiny through the CLI: the JSON keeps its fixed keys and
its values are sane, and ``--plot`` draws a PNG. Then ``benchmarks/bench_core.py``'s exit
code and copy target, on scenario results made up here."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvflow.bench.overhead import FLAT_SHARE, growth
from kvflow.cli import main
from kvflow.copying.host import NATIVE
from tests.support.hosts import require_hosts
from tests.support.pools import require_mooncake


def bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    path = tmp_path / f"{argv[0]}.json"
    png = tmp_path / "x.png"
    assert main(["bench", *argv, "--json", str(path), "--plot", str(png)]) == 0
    result: dict[str, Any] = json.loads(path.read_text())
    assert result["machine"]["cpus"] >= 1
    assert png.is_file() and png.stat().st_size > 5 * 1024
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
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


@pytest.mark.timeout(900)  # the quick tier's longest (~40 s idle), ~4x that on a loaded machine
def test_pool(tmp_path: Path) -> None:
    """The shared pool against the embedded one: real ``kvflow serve`` processes."""
    result = bench(
        tmp_path, "pool", "--layers", "2", "--block-bytes", "4KiB", "--blocks", "32",
        "--repeats", "1", "--round-trip-layers", "2,5", "--lookup-keys", "64",
        "--eviction-requests", "300", "--eviction-pool", "24", "--eviction-checkpoints", "2",
    )  # fmt: skip
    t = result["throughput"]
    assert t["bytes"] == 2 * 32 * 4096
    for kind in ("local", "shared"):
        assert all(v > 0 for v in t["gbps"][kind].values())
        assert result["lookup"][kind]["median_ms"] > 0
    assert set(t["ratio_copy"]) == set(t["ratio_request"]) == {"save", "load"}
    assert [r["layers"] for r in result["round_trips"]] == [2, 5]
    assert {(r["save"], r["load"]) for r in result["round_trips"]} == {(2, 3)}
    assert result["targets"]["round_trips_constant"] is True
    ev = result["eviction"]
    assert (ev["requests"], ev["pool_chunks"]) == (300, 24)
    assert ev["distinct_chunks"] > 4 * ev["pool_chunks"]  # under pressure
    rows = {(r["pattern"], r["pool"]): r for r in ev["rows"]}
    patterns = ("whole", "new", "new_context")
    assert set(rows) == {(p, k) for p in patterns for k in ("before", "local", "shared")}
    for p in patterns:  # one index behind both pools: the same figures
        assert {k: v for k, v in rows[p, "local"].items() if k != "pool"} == {
            k: v for k, v in rows[p, "shared"].items() if k != "pool"
        }
    assert rows["whole", "local"]["reachable_min"] == 1.0
    assert rows["new_context", "local"]["reachable_min"] == 1.0
    assert rows["new_context", "before"] == {**rows["new", "before"], "pattern": "new_context"}
    assert set(ev["context_ratio"]) == {"reachable", "reachable_min", "hit_rate"}
    assert result["targets"]["reachable_ge_0.99"] is True
    assert 0 < rows["whole", "before"]["hit_rate"] <= rows["whole", "local"]["hit_rate"] < 1


def test_mooncake(tmp_path: Path) -> None:
    """kvflow through a real Mooncake master against Mooncake's own calls, same bytes."""
    require_mooncake()
    result = bench(
        tmp_path, "mooncake", "--layers", "4", "--block-bytes", "4KiB", "--blocks", "32",
        "--repeats", "1", "--round-trip-layers", "2,5",
    )  # fmt: skip
    t = result["throughput"]
    assert t["bytes"] == 4 * 32 * 4096 and t["objects"] == 2
    for who in ("raw", "ranged", "kvflow"):
        assert all(v > 0 for v in t["gbps"][who].values())
    assert set(t["ratio"]) == set(t["ratio_to_ranged"]) == {"save", "load"}
    rows = result["round_trips"]
    assert [r["layers"] for r in rows] == [2, 5]
    # the load reads the store's own segment: one more master call (the replicas), per layer
    # a local copy instead of a transfer
    assert result["local_reads"] is True
    assert {(r["save_master"], r["load_master"]) for r in rows} == {(2, 4)}
    assert [r["save_transfers"] for r in rows] == [r["load_local"] for r in rows] == [2, 5]
    assert [r["load_transfers"] for r in rows] == [0, 0]
    assert result["targets"]["round_trips_constant"] is True
    assert result["sessions_api"] is True


@pytest.mark.timeout(600)
def test_disk(tmp_path: Path) -> None:
    """The disk tier's scenario, tiny: real ``kvflow serve`` pools with disk folders."""
    path = tmp_path / "disk.json"
    argv = [
        "bench", "disk", "--requests", "60", "--chunk-bytes", "16KiB", "--objects", "4",
        "--object-bytes", "256KiB", "--layers", "4", "--tokens", "288", "--new-tokens", "32",
        "--repeats", "1", "--quick", "--json", str(path),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(path.read_text())
    assert set(result["hit_rates"]) == {"mix", "sessions"}
    for hits in result["hit_rates"].values():
        rows = {r["pool"]: r for r in hits["rows"]}
        assert set(rows) == {"dram", "dram+disk", "dram of both sizes"}
        assert all(r["wrong_bytes"] == 0 and r["failed_chunks"] == 0 for r in rows.values())
        assert rows["dram+disk"]["hit_rate"] >= rows["dram"]["hit_rate"] > 0
        assert rows["dram+disk"]["chunks_from_disk"] > 0 == rows["dram"]["chunks_from_disk"]
        assert hits["working_set_over_dram"] >= 4
    reads = result["reads"]
    assert len(reads["kvflow_gbps"]) == len(reads["plain_gbps"]) == 1
    assert min(reads["kvflow_gbps"] + reads["plain_gbps"]) > 0
    assert len(result["ttft"]) == 1  # --quick: the pinned runs only
    ttft = result["ttft"][0]
    assert ttft["outputs_identical"] is True and ttft["pinned"] is True
    assert ttft["chunks"] == 1 and ttft["disk_reads_served"] >= 1
    assert ttft["promotions"]["disk_promote"] >= 1
    assert all(v > 0 for v in ttft["ttft_s"].values())


def test_addrgen(tmp_path: Path) -> None:
    result = bench(
        tmp_path, "addrgen", "--blocks", "256", "--block-bytes", "4KiB", "--repeats", "1"
    )
    rows = result["rows"]
    assert len(rows) == 2  # block ids in order, and random
    for row in rows:
        assert row["blocks"] == 256
        # figures, not a race: one timed repeat on a shared machine can go either way
        vectorized, python = row["vectorized_us_per_layer"], row["python_us_per_layer"]
        assert vectorized > 0 and python > 0
        assert row["speedup"] == pytest.approx(python / vectorized, rel=0.02, abs=0.06)
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
    # the flatness property: a bool and finite figures (a run this small is too noisy to
    # assert its value)
    assert isinstance(result["per_request_per_layer_flat"], bool)
    assert math.isfinite(result["growth_per_request_us_per_layer"])
    assert 0 < result["flat_share"] < 1
    assert {(g["api"], g["op"]) for g in result["growth"]} == {
        (api, op) for api in ("async", "sync") for op in ("load", "save")
    }
    for g in result["growth"]:
        assert isinstance(g["flat"], bool) and g["fewest_requests"] == 1
        for key in ("growth_per_request_us_per_layer", "layer_loop_growth_per_request_us"):
            assert math.isfinite(g[key])
        assert g["flat"] == (g["growth_share"] < result["flat_share"])
    flats = [g["flat"] for g in result["growth"]]
    assert result["per_request_per_layer_flat"] == all(flats)


def test_overhead_growth_fit() -> None:
    def rows(costs: dict[int, float]) -> list[dict[str, Any]]:
        return [
            {
                "api": "async",
                "op": "load",
                "requests": r,
                "us_per_layer_step": c,
                "layer_loop_us_per_layer": c / 2,
            }
            for r, c in costs.items()
        ]

    batched = growth(rows({1: 100.0, 16: 103.0, 256: 151.0}))[0]  # + 0.2 us a request
    assert batched["growth_per_request_us_per_layer"] == pytest.approx(0.2)
    assert batched["layer_loop_growth_per_request_us"] == pytest.approx(0.1)
    assert batched["growth_share"] == pytest.approx(0.002) and batched["flat"]
    per_request = growth(rows({1: 100.0, 4: 400.0, 16: 1600.0}))[0]  # linear in requests
    assert per_request["growth_share"] == pytest.approx(1.0) and not per_request["flat"]
    assert growth(rows({1: 100.0, 2: 100 + 100 * FLAT_SHARE}))[0]["flat"] is False
    single = growth(rows({4: 100.0}))[0]
    assert single["flat"] is None and single["growth_per_request_us_per_layer"] is None


def _bench_core() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_core.py"
    spec = importlib.util.spec_from_file_location("bench_core", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_row(block: int, ratio: float) -> dict[str, Any]:
    return {
        "block_bytes": block,
        "coalesced": True,
        "threads": 1,
        "loop": "native",
        "ratio_to_memcpy": ratio,
    }


@pytest.mark.parametrize(
    ("copy_rows", "exit_codes", "argv", "expected"),
    [
        # every block size >= 64 KiB at 85 % or more: PASS
        ([(4 << 10, 0.9), (64 << 10, 0.9), (128 << 10, 0.95), (1 << 20, 0.9)], {}, [], 0),
        # 64 KiB below 85 % while 128 KiB passes: FAIL (exit 1 with --strict)
        ([(4 << 10, 0.9), (64 << 10, 0.8), (128 << 10, 0.95)], {}, ["--strict"], 1),
        ([(4 << 10, 0.9), (64 << 10, 0.8), (128 << 10, 0.95)], {}, [], 0),
        # a scenario's own exit code comes through, --strict or not
        ([(4 << 10, 0.9), (64 << 10, 0.9)], {"addrgen": 3}, [], 3),
    ],
)
def test_bench_core(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    copy_rows: list[tuple[int, float]],
    exit_codes: dict[str, int],
    argv: list[str],
    expected: int,
) -> None:
    core = _bench_core()
    results: dict[str, dict[str, Any]] = {
        "copy": {"rows": [_copy_row(b, r) for b, r in copy_rows]},
        "addrgen": {"rows": [{"blocks": 512, "speedup": 30.0, "share_of_copy_time": 0.01}]},
        "metadata": {"rows": [{"kvflow_calls_per_request": 5, "layer_factor": 8.0, "layers": 8}]},
    }

    def fake_kvflow(args: list[str]) -> int:
        name, path = args[1], Path(args[args.index("--json") + 1])
        path.write_text(json.dumps(results[name]))
        return exit_codes.get(name, 0)

    monkeypatch.setattr(core, "OUT", tmp_path)
    monkeypatch.setattr(core, "kvflow", fake_kvflow)
    monkeypatch.setattr(sys, "argv", ["bench_core.py", *argv])
    assert core.main() == expected
    out = capsys.readouterr().out
    large = [r for b, r in copy_rows if b >= 64 << 10]
    assert ("PASS  batch_copy at every block size >= 64 KiB" in out) == (min(large) >= 0.85)


def test_hosts(tmp_path: Path) -> None:
    """The multi-host scenario, tiny: real namespaces, a real master, real Mooncake clients."""
    require_hosts()
    require_mooncake()
    path = tmp_path / "hosts.json"
    argv = ["bench", "hosts", "--prompts", "4", "--chunks", "2", "--faults", "slow_link", "--quick"]
    assert main([*argv, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [r["readers"] for r in result["throughput"]] == [1, 2, 3]
    for run in result["throughput"]:
        assert run["wrong"] == run["failed"] == 0
        assert run["bytes"] == run["readers"] * 4 * 2 * result["object_bytes"]
        assert run["gbps"] > 0 and run["master_calls_per_batch"] == [2]
    (fault,) = result["faults"]
    assert fault["fault"] == "slow_link" and fault["wrong_chunks"] == 0
    assert fault["recovered_s"] is not None and fault["all_recovered_s"] is not None
