"""``KVFLOW_TRACE`` in ``kvflow serve``: a trace file of the pool's requests, role ``pool``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvflow
from kvflow import trace
from tests.support.processes import ServeProcess


def test_kvflow_serve_traces_the_requests_it_serves(
    sock_dir: str,
    serve: Callable[..., ServeProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(trace.ENV, str(tmp_path / "kv.json"))
    path = f"{sock_dir}/pool.sock"
    server = serve(path, "4MiB")
    store = kvflow.SharedStore(socket=path)
    try:
        session = store.open_write(["a"], 8192)
        store.finish_write(session, np.ones(1, dtype=bool))
        store.close_read(store.open_read(["a"]))
    finally:
        store.close()
    server.stop()  # SIGTERM: the server exits, and its trace is complete JSON
    assert server.proc.returncode == 0, server.log()  # its own exit, not the SIGKILL after
    (written,) = tmp_path.iterdir()
    assert written.name == f"kv.pool-{server.pid}.json"
    events = json.loads(written.read_text())
    served = [e["name"] for e in events if e.get("cat") == "pool"]
    for op in ("pool.open_write", "pool.finish_write", "pool.open_read", "pool.close_read"):
        assert served.count(op) == 1, served
    assert {e["pid"] for e in events} == {server.pid}
