"""``KVFLOW_TRACE``: a Chrome / Perfetto trace per process, off unless asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvflow import trace

REPO = Path(__file__).resolve().parents[1]
LAYERS = 4


def run(store: str, env: dict[str, str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != trace.ENV} | env
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.trace_run", store],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def load_trace(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        events = json.load(f)  # the whole file is JSON once the process ended
    assert isinstance(events, list)
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= e.keys()
        if e["ph"] != "M":
            assert isinstance(e["ts"], float) and e["cat"]
        if e["ph"] == "X":
            assert e["dur"] >= 0
    return events


def per_layer(events: list[dict[str, Any]], name: str) -> list[int]:
    return sorted(e["args"]["layer"] for e in events if e["name"] == name and e["ph"] == "X")


@pytest.mark.parametrize("store", ["local", "shared"])
def test_a_traced_run_writes_a_chrome_trace_per_process(store: str, tmp_path: Path) -> None:
    result = run(store, {trace.ENV: str(tmp_path / "kv.json")})
    assert result["enabled"]
    path = result["file"]
    assert Path(path).parent == tmp_path and Path(path).name.startswith("kv.engine-")
    events = load_trace(path)
    layers = list(range(LAYERS))
    assert per_layer(events, "save_copy") == layers  # the caller's thread (inline saves)
    assert per_layer(events, "load_copy") == layers  # the copy threads
    assert per_layer(events, "layer_written") == layers  # the caller's thread
    assert per_layer(events, "wait_layer") == layers
    names = Counter(e["name"] for e in events)
    for call in ("store.open_write", "store.finish_write", "store.open_read", "store.close_read"):
        assert names[call] == 1, names
    if store == "shared":  # the pool server, here in the same process
        for call in ("pool.open_write", "pool.finish_write", "pool.open_read", "pool.close_read"):
            assert names[call] == 1, names

    def tids(name: str) -> set[int]:
        return {e["tid"] for e in events if e["name"] == name}

    assert tids("load_copy").isdisjoint(tids("wait_layer"))  # loads on the copy thread
    assert tids("save_copy") == tids("layer_written")  # an inline save's on the caller's
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert all(threads[t].startswith("kvflow-copy") for t in tids("load_copy")), threads
    assert any(e["name"] == "process_name" for e in events)


def test_tracing_is_off_by_default(tmp_path: Path) -> None:
    result = run("local", {})
    assert result == {"enabled": False, "file": None}
    assert list(tmp_path.iterdir()) == []


def test_path_for_adds_role_and_pid() -> None:
    assert trace.path_for("/tmp/kv.json", "worker", 42) == "/tmp/kv.worker-42.json"
    assert trace.path_for("/tmp/kv", "pool", 7) == "/tmp/kv.pool-7.json"
