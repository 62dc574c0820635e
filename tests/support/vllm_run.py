"""One vLLM run, in a process of its own: ``python -m tests.support.vllm_run ARGS_JSON OUT_JSON``.

Runs with the interpreter that has vLLM (``$KVFLOW_VLLM_PYTHON``). ARGS: ``model`` (a directory
from ``tests.support.vllm.build_model``), ``prompts`` (lists of token ids, generated as one
batch unless ``one_by_one``), ``max_tokens``, ``extra`` (the connector's
``kv_connector_extra_config``; absent: no connector), ``failure_policy`` (vLLM's
``kv_load_failure_policy``, "recompute" unless given), ``llm`` (more ``LLM(...)`` arguments),
``pool_socket`` (a kvflow pool to count requests on). Writes per prompt the greedy tokens, the
tokens vLLM did not compute (``num_cached_tokens``: the connector's hits, unless ``llm`` turns
vLLM's prefix caching on), the time to first token and the finish reason; with ``pool_socket``,
``pool_requests``: the pool's request counter before the first batch, after each batch, and
once more after the last (so the last difference is what counting alone costs). With
``counters`` (true), ``counters``: vLLM's counters after the last batch (``LLM.get_metrics``,
summed over labels), such as ``vllm:spec_decode_num_draft_tokens``. With
``force_prefix_caching`` (true), vLLM's prefix cache stays on where its CPU platform turns it
off (MLA models), as a reference for connector hits. ``kv_role``: vLLM's (``kv_both`` unless
given). With ``fail_layer`` (a layer index), that decoder layer's forward raises once the
instance is up (as a model vLLM's kernels cannot run would): the first batch's error is
written as ``error`` and no batch runs after it; needs vLLM's engine core in this process.

``python -m tests.support.vllm_run --fork-server`` imports vLLM once and then, for each request
line on its standard input (``{"args", "out", "log", "env", "limit_s"}``), forks a child that
runs it as above in a process group of its own, its output in ``log``, ``env`` set and an alarm
at ``limit_s``: each run is a fresh process without paying vLLM's import again (~8 s here). It
answers each request with two lines, ``{"pid"}`` when the child started and ``{"status"}`` (its
exit code) when it ended.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any, NoReturn


def main(args: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": args["model"],
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "block_size": args.get("block_size", 32),
        "max_model_len": args.get("max_model_len", 4096),
        "max_num_seqs": 8,
        "seed": 0,
        "disable_log_stats": False,
    }
    if "extra" in args:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVFlowConnector",
            "kv_connector_module_path": "kvflow.integrations.vllm",
            "kv_role": args.get("kv_role", "kv_both"),
            "kv_load_failure_policy": args.get("failure_policy", "recompute"),
            "kv_connector_extra_config": args["extra"],
        }
    kwargs.update(args.get("llm", {}))
    if args.get("force_prefix_caching"):
        _force_prefix_caching()
        kwargs["enable_prefix_caching"] = True
    started = time.monotonic()
    llm = LLM(**kwargs)
    ready_s = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.get("max_tokens", 8), ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
    outputs = []
    batches = [[p] for p in prompts] if args.get("one_by_one") else [prompts]
    pool_socket = args.get("pool_socket")
    requests = [_pool_requests(pool_socket)] if pool_socket else []
    error = None
    if "fail_layer" in args:
        _fail_layer(args["fail_layer"])
    for batch in batches:
        try:
            outputs.extend(llm.generate(batch, params, use_tqdm=False))
        except Exception as exc:
            if "fail_layer" not in args:
                raise
            error = repr(exc)
            break
        if pool_socket:
            requests.append(_pool_requests(pool_socket))
    if pool_socket:
        requests.append(_pool_requests(pool_socket))
    result: dict[str, Any] = {
        "ready_s": ready_s,
        "outputs": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens,
                "ttft_s": o.metrics.first_token_latency if o.metrics else None,
                "finish_reason": o.outputs[0].finish_reason,
            }
            for o in outputs
        ],
        "pool_requests": requests,
        "error": error,
    }
    if args.get("counters"):
        result["counters"] = _counters(llm)
    del llm
    return result


def _force_prefix_caching() -> None:
    """Keep vLLM's prefix cache on after the CPU platform's config check, which turns it off
    for MLA models (with chunked prefill). The config is made in this process, before the engine
    core starts, so the patch reaches it."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def keep_prefix_caching(cls: Any, vllm_config: Any) -> None:
        check(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    CpuPlatform.check_and_update_config = classmethod(keep_prefix_caching)


def _fail_layer(index: int) -> None:
    """Make decoder layer ``index`` of a Llama model raise in its forward, before its attention
    (the layers before it ran, with their connector hooks)."""
    from vllm.model_executor.models.llama import LlamaDecoderLayer

    forward = LlamaDecoderLayer.forward
    name = f"layers.{index}."

    def failing(self: Any, *a: Any, **k: Any) -> Any:
        if name in self.self_attn.attn.layer_name:
            raise RuntimeError(f"the model failed at layer {index} (a test's doing)")
        return forward(self, *a, **k)

    LlamaDecoderLayer.forward = failing


def _counters(llm: Any) -> dict[str, int]:
    from vllm.v1.metrics.reader import Counter

    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0) + int(metric.value)
    return out


def _pool_requests(pool_socket: str) -> int:
    from kvflow.pool.client import query_stats

    return int(query_stats(pool_socket, timeout_s=10.0)["requests"])


def run_file(arg_path: str, out_path: str) -> None:
    with open(arg_path) as f:
        arguments = json.load(f)
    out = main(arguments)
    with open(out_path, "w") as f:
        json.dump(out, f)


def fork_server() -> None:
    """Import vLLM, then fork a child per request line until standard input closes."""
    import vllm  # noqa: F401 - what every run would import again
    from vllm.inputs import TokensPrompt  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"status": os.waitstatus_to_exitcode(status)})


def _answer(message: dict[str, int]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _child(request: dict[str, Any]) -> NoReturn:
    """Run one request in this forked child and exit as a process does (atexit handlers run:
    vLLM stops what it started)."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own: a run past its time is killed with its children
        signal.alarm(int(request["limit_s"]))  # ends the run even if nobody is left to kill it
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.update(request["env"])
        run_file(request["args"], request["out"])
        code = 0
    except BaseException:
        traceback.print_exc()
    raise SystemExit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        fork_server()
    else:
        run_file(sys.argv[1], sys.argv[2])
