"""Prefill/decode disaggregation benchmark: a ``kv_producer`` and a ``kv_consumer`` ``vllm serve``
on one KV pool, per row, against one instance without a connector.

    $KVFLOW_VLLM_PYTHON benchmarks/vllm_pd.py [--quick] [--repeats N] [--rows a,b,...]
        [--json PATH]

Rows: ``kvflow_shared`` (KVFlowConnector on the node's shared pool, started by the first
instance on a private socket), ``kvflow_shared_both`` (the same with the prefill instance in
``kv_both``: a producer's cost against an instance that is not one), ``kvflow_mooncake``
(KVFlowConnector on a ``mooncake_master`` of its own), ``mooncake_store_connector`` (vLLM's
``MooncakeStoreConnector`` in the same roles,
``P2PHANDSHAKE`` metadata, TCP on loopback, a master of its own). Beside them ``single``: one
instance without a connector, for the reference tokens and the single-instance TTFT.

Every server runs with ``VLLM_CPU_OMP_THREADS_BIND=nobind``: with vLLM's CPU binding (its
default), a worker's model thread is bound to one core, and threads the connector starts
inherit that core. ``MooncakeStoreConnector``'s transfer threads then starve behind the model
thread, and the consumer's reads of the producer's segment time out (``ClientSession: no status
frame within 30s``, ``Transfer failed for key ... with error: -800``, the request failed under
``kv_load_failure_policy: fail``); kvflow pins its own threads to spare cores (``copy_cpus``)
and runs either way. Unbound, every row runs on the same footing; ``OMP_NUM_THREADS=1`` gives
each instance one compute thread, so that a pair does not oversubscribe a 2-core machine. The
model runs in float32 (``--dtype float32``): in bfloat16 the tokens after a prefix computed in
another step differ from a one-pass prefill's on some prompts, whatever the connector.

Each request is sent as ``examples/pd_proxy.py`` sends it, with this process as the proxy (so
each leg is timed): the prompt to the producer with ``max_tokens`` 1, and the moment it
answered (no sleep) the whole request to the consumer, streamed. ``--concurrency`` requests at
once. Before those, per row, the producer alone answers other new prompts with one token
(``prefill_alone``: its time against the instance without a connector's on the same prompts,
the cost of saving, commit included, with no decode instance busy beside it). Per row: the
producer's time to answer within the P/D requests (``prefill_ms``), the consumer's time to first
token (``decode_ttft``, mean/p50/p99 over every repeat's requests), the proxy's (both legs:
what a client of the proxy sees), the consumer's external hit tokens against its prompt tokens
(vLLM's ``/metrics``), the tokens the consumer saved (kvflow's counter), and the requests whose
tokens differ from ``single``'s. Per repeat, new prompts (a seed of their own) and the rows in a
balanced order; every server starts once. Ratios against ``mooncake_store_connector`` are per
repeat, median over the repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.stores.mooncake.master import MooncakeMaster

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the serving helpers are shared with the tests
from tests.support.serve import (  # noqa: E402
    Server,
    kvflow_mooncake_extra,
    kvflow_transfer_config,
    mooncake_store_connector_env,
    order,
    serve_args,
    stop_pool,
    stream_completion,
    write_report,
)

OUT = REPO / "bench-results"
ROWS = ("kvflow_shared", "kvflow_shared_both", "kvflow_mooncake", "mooncake_store_connector")
PEER = "mooncake_store_connector"
VOCAB = 1024  # the random model's
FULL = {"layers": 8, "hidden": 512, "prompts": 24, "prompt_len": 1000, "output_len": 16}
QUICK = {"layers": 4, "hidden": 256, "prompts": 8, "prompt_len": 1000, "output_len": 8}
BLOCK = 32
DEVICE_BLOCKS = 160  # 5120 tokens: the running requests and little more
MAX_MODEL_LEN = 2048
POOL = "1GiB"
REQUEST_TIMEOUT_S = 120.0  # one leg; a pool that stalls longer fails the request
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}  # see the docstring


PD_ROLES = {"kv_producer": "kv_producer", "kv_consumer": "kv_consumer"}


def start(
    rows: list[str],
    model: str,
    concurrency: int,
    work: Path,
    stack: contextlib.ExitStack,
    roles: dict[str, str] = PD_ROLES,
    num_blocks: int = DEVICE_BLOCKS,
) -> dict[str, dict[str, Server]]:
    """Per row a server in each of ``roles`` (its name: vLLM's ``kv_role``) on the row's pool,
    by default its producer and consumer; ``single``: one server without a connector. All
    started at once, waited for, and stopped with their pools and masters when ``stack``
    closes."""
    servers: dict[str, dict[str, Server]] = {}

    def launch(row: str, role: str, transfer: dict[str, Any] | None, env: dict[str, str]) -> None:
        args = serve_args(
            block_size=BLOCK,
            num_blocks=num_blocks,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=concurrency,
            kv_transfer_config=transfer,
        )
        args += ["--dtype", "float32"]
        log = work / f"{row}-{role}.log"
        server = Server(sys.executable, model, args, log=log, env={**ENV, **env}, cwd=str(REPO))
        stack.callback(server.stop)
        servers.setdefault(row, {})[role] = server

    launch("single", "single", None, {})
    for row in rows:
        env: dict[str, str] = {}
        for role, kv_role in roles.items():
            if row in ("kvflow_shared", "kvflow_shared_both"):
                if not env:
                    directory = tempfile.mkdtemp(prefix="kvpd-", dir="/tmp")
                    env["KVFLOW_POOL_SOCKET"] = f"{directory}/pool.sock"
                    stack.callback(shutil.rmtree, directory, ignore_errors=True)
                    stack.callback(stop_pool, env["KVFLOW_POOL_SOCKET"])
                both = row == "kvflow_shared_both" and role == "kv_producer"
                transfer = kvflow_transfer_config({}, "kv_both" if both else kv_role)
            elif row == "kvflow_mooncake":
                if not env:
                    env["master"] = stack.enter_context(MooncakeMaster()).address
                extra = kvflow_mooncake_extra(env["master"], POOL)
                transfer = kvflow_transfer_config(extra, kv_role)
            else:
                if not env:
                    master = stack.enter_context(MooncakeMaster()).address
                    segment = POOL.replace("iB", "B")  # Mooncake reads "1GB"
                    env.update(mooncake_store_connector_env(work / f"{row}.json", master, segment))
                transfer = {
                    "kv_connector": "MooncakeStoreConnector",
                    "kv_role": kv_role,
                    "kv_load_failure_policy": "recompute",  # as kvflow's rows
                }
            launch(row, role, transfer, {k: v for k, v in env.items() if k != "master"})
    for row, group in servers.items():
        for server in group.values():
            server.ready()
        print(f"{row}: up", file=sys.stderr)
    return servers


def counters(server: Server) -> dict[str, float]:
    m = server.metrics()
    return {
        "prompt_tokens": m.get("vllm:prompt_tokens_total", 0.0),
        "hit_tokens": m.get("vllm:external_prefix_cache_hits_total", 0.0),
        "saved_tokens": m.get("vllm:kvflow_saved_tokens_total", 0.0),
    }


def prompts(spec: dict[str, int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    n, length = spec["prompts"], spec["prompt_len"]
    return [
        [
            int(t)
            for t in rng.integers(3, VOCAB, int(rng.integers(length * 9 // 10, length * 11 // 10)))
        ]
        for _ in range(n)
    ]


def pd_request(
    producer: Server, consumer: Server, prompt: list[int], output: int
) -> dict[str, Any]:
    """One request as the proxy sends it: prefill (one token), then at once the decode. A
    request that fails is recorded with its ``error``."""
    begun = time.perf_counter()
    try:
        stream_completion(producer.url, prompt, max_tokens=1, timeout=REQUEST_TIMEOUT_S)
        prefilled = time.perf_counter()
        out = stream_completion(consumer.url, prompt, max_tokens=output, timeout=REQUEST_TIMEOUT_S)
    except (OSError, RuntimeError) as exc:
        return {"error": repr(exc), "after_s": time.perf_counter() - begun}
    return {
        "prefill_s": prefilled - begun,
        "decode_ttft_s": out["ttft_s"],
        "proxy_ttft_s": prefilled - begun + out["ttft_s"],
        "tokens": out["tokens"],
    }


def prefill_only(server: Server, batch: list[list[int]], concurrency: int) -> list[float]:
    """Each prompt's time to answer with one token, ``concurrency`` at a time, on ``server``
    alone (no decode instance busy beside it)."""

    def one(prompt: list[int]) -> float:
        begun = time.perf_counter()
        stream_completion(server.url, prompt, max_tokens=1, timeout=REQUEST_TIMEOUT_S)
        return time.perf_counter() - begun

    with ThreadPoolExecutor(concurrency) as threads:
        return list(threads.map(one, batch))


def run_row(
    row: str,
    group: dict[str, Server],
    batch: list[list[int]],
    fresh: list[list[int]],
    spec: dict[str, int],
    concurrency: int,
) -> dict[str, Any]:
    """The row's P/D requests on ``batch``; before them, the producer alone (``single``: the
    instance without a connector) on the ``fresh`` prompts."""
    output = spec["output_len"]
    first = group["single"] if row == "single" else group["kv_producer"]
    alone = prefill_only(first, fresh, concurrency)
    if row == "single":
        server = group["single"]

        def one(prompt: list[int]) -> dict[str, Any]:
            out = stream_completion(
                server.url, prompt, max_tokens=output, timeout=REQUEST_TIMEOUT_S
            )
            return {"ttft_s": out["ttft_s"], "tokens": out["tokens"]}

        with ThreadPoolExecutor(concurrency) as threads:
            return {"requests": list(threads.map(one, batch)), "prefill_alone_s": alone}
    producer, consumer = group["kv_producer"], group["kv_consumer"]
    before = counters(consumer)
    with ThreadPoolExecutor(concurrency) as threads:
        requests = list(threads.map(lambda p: pd_request(producer, consumer, p, output), batch))
    after = counters(consumer)
    consumer_counts = {k: after[k] - before[k] for k in after}
    return {"requests": requests, "consumer": consumer_counts, "prefill_alone_s": alone}


def stats_ms(values: list[float]) -> dict[str, float]:
    ms = np.asarray(values) * 1e3
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
    }


def answered(sample: dict[str, Any], key: str) -> list[float]:
    return [r[key] for r in sample["requests"] if "error" not in r]


def summarize(samples: dict[str, list[dict[str, Any]]], rows: list[str]) -> dict[str, Any]:
    single = samples["single"]
    out: dict[str, Any] = {
        "single": {
            "ttft_ms": stats_ms([r["ttft_s"] for s in single for r in s["requests"]]),
            "prefill_alone_ms": stats_ms([t for s in single for t in s["prefill_alone_s"]]),
        }
    }
    for row in rows:
        runs = samples[row]
        reqs = [r for s in runs for r in s["requests"] if "error" not in r]
        failed = sum("error" in r for s in runs for r in s["requests"])
        if not reqs:
            out[row] = {"failed_requests": failed}
            continue
        differ = [
            sum(
                a.get("tokens") != b["tokens"]
                for a, b in zip(s["requests"], ref["requests"], strict=True)
            )
            for s, ref in zip(runs, single, strict=True)
        ]
        consumer = {k: sum(s["consumer"][k] for s in runs) for k in runs[0]["consumer"]}
        out[row] = {
            "decode_ttft_ms": stats_ms([r["decode_ttft_s"] for r in reqs]),
            "proxy_ttft_ms": stats_ms([r["proxy_ttft_s"] for r in reqs]),
            "prefill_ms": stats_ms([r["prefill_s"] for r in reqs]),
            "prefill_alone_ms": stats_ms([t for s in runs for t in s["prefill_alone_s"]]),
            # the producer alone against the instance without a connector, per repeat (median)
            "prefill_alone_vs_single": statistics.median(
                float(np.mean(s["prefill_alone_s"]) / np.mean(ref["prefill_alone_s"]))
                for s, ref in zip(runs, single, strict=True)
            ),
            "hit_share": consumer["hit_tokens"] / consumer["prompt_tokens"],
            "consumer_saved_tokens": consumer["saved_tokens"],
            "differing_requests": differ,
            "failed_requests": failed,
        }
    if PEER in rows and "decode_ttft_ms" in out[PEER]:  # over the peer's answered requests
        for row in (r for r in rows if "decode_ttft_ms" in out[r]):
            ratios: dict[str, float] = {}
            for what in ("decode_ttft", "proxy_ttft"):
                for stat in ("mean", "p99"):
                    per_repeat = [
                        stats_ms(answered(mine, f"{what}_s"))[stat]
                        / stats_ms(answered(peer, f"{what}_s"))[stat]
                        for mine, peer in zip(samples[row], samples[PEER], strict=True)
                        if answered(mine, f"{what}_s") and answered(peer, f"{what}_s")
                    ]
                    ratios[f"{what}_{stat}"] = statistics.median(per_repeat)
            out[row]["vs_peer"] = ratios
    return out


def print_table(summary: dict[str, Any], rows: list[str]) -> None:
    s = summary["single"]["ttft_ms"]
    alone = summary["single"]["prefill_alone_ms"]["mean"]
    print(f"single instance, no connector: TTFT mean {s['mean']:.0f} p50 {s['p50']:.0f} "
          f"p99 {s['p99']:.0f} ms; one-token answers alone: mean {alone:.0f} ms")  # fmt: skip
    for row in rows:
        if "prefill_alone_ms" in summary[row]:
            r = summary[row]
            mean, ratio = r["prefill_alone_ms"]["mean"], r["prefill_alone_vs_single"]
            print(f"  {row} producer alone: mean {mean:.0f} ms, {ratio:.3f}x no connector")
    head = "row                       decode TTFT mean/p50/p99   proxy TTFT mean/p99  prefill mean  hits   saved  differ  vs peer (decode mean/p99)"  # noqa: E501
    print(head)
    for row in rows:
        r = summary[row]
        if "decode_ttft_ms" not in r:
            print(f"{row:25s} every request failed ({r['failed_requests']})")
            continue
        d, p, f = r["decode_ttft_ms"], r["proxy_ttft_ms"], r["prefill_ms"]
        vs = r.get("vs_peer", {})
        ratio = f"{vs['decode_ttft_mean']:.2f}x / {vs['decode_ttft_p99']:.2f}x" if vs else "-"
        print(
            f"{row:25s} {d['mean']:6.0f} {d['p50']:6.0f} {d['p99']:6.0f}      "
            f"{p['mean']:6.0f} {p['p99']:6.0f}      {f['mean']:6.0f}  {r['hit_share']:5.1%} "
            f"{r['consumer_saved_tokens']:6.0f}  {sum(r['differing_requests']):4d}    {ratio}"
            + (f"  ({r['failed_requests']} failed)" if r["failed_requests"] else "")
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--json", default=str(OUT / "vllm_pd.json"))
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: the servers, pools and masters started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    repeats = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    spec = QUICK if args.quick else FULL
    from kvflow.testing.models import build

    name = f"kvflow-pd-llama-{spec['layers']}x{spec['hidden']}"
    model = str(
        build(f"{tempfile.gettempdir()}/{name}", layers=spec["layers"], hidden=spec["hidden"])
    )
    work = Path(tempfile.mkdtemp(prefix="kvpd-", dir="/tmp"))
    started, load_before = time.monotonic(), os.getloadavg()
    samples: dict[str, list[dict[str, Any]]] = {row: [] for row in ("single", *rows)}
    with contextlib.ExitStack() as stack:
        servers = start(rows, model, args.concurrency, work, stack)
        for i in range(repeats):
            batch, fresh = prompts(spec, seed=1000 + i), prompts(spec, seed=5000 + i)
            for row in order(["single", *rows], i):
                sample = run_row(row, servers[row], batch, fresh, spec, args.concurrency)
                samples[row].append(sample)
                print(f"repeat {i}: {row} done", file=sys.stderr)
    summary = summarize(samples, rows)
    document = {
        "summary": summary,
        "samples": samples,
        "spec": spec,
        "concurrency": args.concurrency,
        "device_blocks": DEVICE_BLOCKS,
        "block": BLOCK,
        "repeats": repeats,
        "rows": rows,
    }
    write_report(args.json, document, started=started, load_before=load_before, work=work)
    print_table(summary, rows)
    print(f"JSON: {args.json}; logs: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
