"""Serving benchmark: real ``vllm serve`` processes with and without a KV connector, driven over
HTTP by many concurrent requests whose prompts share prefixes, with device KV several times
smaller than the working set.

    $KVFLOW_VLLM_PYTHON benchmarks/vllm_serve.py [--quick] [--repeats N] [--rows a,b,...]
        [--json PATH] [--plot PATH]

Rows (every server: vLLM's defaults, so its own prefix cache on; ``--num-gpu-blocks-override``
caps device KV): ``prefix_cache`` (no connector), ``kvflow`` (KVFlowConnector, no settings:
the shared pool it starts itself, here on a private socket via ``KVFLOW_POOL_SOCKET``),
``kvflow_mooncake`` (kvflow on a ``mooncake_master`` of its own), ``mooncake_store_connector``
(vLLM's, on a master of its own) and ``kvflow_two_servers`` (two servers on one kvflow pool;
requests alternate between them: a conversation's next turn goes to the other server). Rows
run on request only: ``kvflow_chunkN``, the ``kvflow`` row with chunks of ``N`` tokens
(``chunk_blocks`` = N / block size) instead of the default; ``kvflow_small_pool``, the
``kvflow`` row with a pool (DRAM) half the larger workload's KV, and
``kvflow_small_pool_disk``, the same with a disk tier under it that holds the whole of it
(``shared``'s ``disk_dir``, ``disk_capacity``: the pool it starts has them); ``floor``, vLLM's
prefix cache alone
with device KV for the whole working set and every running request beside it (what any
connector could at best give: every prefix a device hit); ``kvflow_floor`` and
``mooncake_store_connector_floor``, those connectors on the floor's device KV (the pool adds
nothing there: what its lookups and saves cost a prefix cache that hits on its own); and, to
take that cost apart, ``kvflow_idle_floor`` (the connector and its pool, with ``load`` and
``save`` off), ``kvflow_lookups_floor`` (``save`` off) and ``kvflow_saves_floor`` (``load``
off), and ``kvflow_thread_saves_floor`` (``inline_saves`` and ``deferred_saves`` off: every
layer's save through the copy thread as it is written); ``kvflow_no_tails`` and
``kvflow_mooncake_no_tails``, those rows with ``tail_chunks`` off (a hit ends at a whole
chunk), and ``kvflow_no_tails_floor``, the ``kvflow_floor`` row with it off;
``kvflow_mooncake_layer_saves``, kvflow on Mooncake with ``deferred_saves`` off (each layer's
save handed to the copy thread as it is written, not all after the last);
``kvflow_across``, ``kvflow_across_floor`` and ``kvflow_mooncake_across``, those rows with
``save_across_steps`` on (a step's save ends beside the next step).

Workloads, the same prompts on every row: ``bench``, vLLM's own client
(``vllm.benchmarks.serve``, in this process) on its ``prefix_repetition`` dataset (prompts
sharing a few long prefixes, shuffled), ``--max-concurrency`` requests at once; for the
two-server row it goes through a round-robin proxy here (one more local hop). ``chat``, this
module's multi-turn client (aiohttp, streaming ``/v1/completions`` on token ids): conversations
that share a system prompt, each turn carrying the previous turns and their answers, all
conversations at once. Greedy, ``ignore_eos``, fixed output lengths. Every server starts once;
each repeat draws new prompts (its own seed) and runs the rows in a balanced order. Per row and
workload: mean, median and p99 TTFT over all repeats' requests, output throughput (mean over
repeats), tokens the connector provided (``vllm:external_prefix_cache_hits_total``) and the
prompt tokens vLLM computed itself (``local_compute`` in ``vllm:prompt_tokens_by_source``),
vLLM's own split of the time to first token (mean queue and prefill time per request), per
repeat how many requests gave other tokens than the ``prefix_cache`` row and than the
``mooncake_store_connector`` row on the same prompt, and per-repeat ratios (median over
repeats) of mean TTFT, p99 TTFT and throughput against ``mooncake_store_connector``, against
``prefix_cache`` and (in the JSON) against ``floor``. Also the CPU time per request that the
row's processes used while it ran (read from ``/proc`` before and after each sample: vLLM's
API server, engine core and worker, each with every thread it runs, a connector's included,
and the pool's process, ``kvflow serve`` or ``mooncake_master``), with the same per-repeat
ratios of its total. The engine core polls while it waits, so its time follows the wall
time; over a run, the worker's and the pool's say what a connector adds to them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.stores.mooncake.master import MooncakeMaster

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the serving helpers are shared with the tests
from tests.support.serve import (  # noqa: E402
    MODEL_NAME,
    Server,
    chunk_tokens,
    cpu_by_role,
    free_port,
    kvflow_mooncake_extra,
    kvflow_transfer_config,
    labelled,
    mooncake_store_connector_env,
    order,
    pool_pid,
    serve_args,
    stop_pool,
    write_report,
)

OUT = REPO / "bench-results"
ROWS = (
    "prefix_cache",
    "kvflow",
    "kvflow_mooncake",
    "mooncake_store_connector",
    "kvflow_two_servers",
)
ON_REQUEST = (
    "floor",
    "kvflow_small_pool",
    "kvflow_small_pool_disk",
    "kvflow_floor",
    "mooncake_store_connector_floor",
    *(f"kvflow_{part}_floor" for part in ("idle", "lookups", "saves", "thread_saves")),
    "kvflow_no_tails",
    "kvflow_mooncake_no_tails",
    "kvflow_no_tails_floor",
    "kvflow_mooncake_layer_saves",
    "kvflow_across",
    "kvflow_across_floor",
    "kvflow_mooncake_across",
)  # and kvflow_chunkN
# the ``kvflow_*_floor`` rows that do part of the connector's work: what the rest leaves out
PARTS: dict[str, dict[str, bool]] = {
    "idle": {"load": False, "save": False},
    "lookups": {"save": False},
    "saves": {"load": False},
    "thread_saves": {"inline_saves": False, "deferred_saves": False},  # the saves' other way
}
CHUNK_ROW = re.compile(r"kvflow_chunk([1-9][0-9]*)")  # kvflow with chunks of that many tokens
WORKLOADS = ("bench", "chat")
VOCAB = 1024  # the random model's


@dataclass(frozen=True)
class Shape:
    """The model, the device KV and the workloads of one run."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    block: int
    num_blocks: int  # device KV, in blocks
    max_model_len: int
    prefix_len: int  # bench: prefixes, the prompts' own suffixes, their number, requests
    suffix_len: int
    num_prefixes: int
    num_prompts: int
    concurrency: int
    output_len: int
    conversations: int  # chat
    turns: int
    system_len: int
    first_len: int
    user_len: int
    answer_len: int
    pool: str  # capacity of each pool (kvflow's, Mooncake's segments)

    def working_set(self) -> dict[str, int]:
        """Tokens of KV each workload touches, beside the device's."""
        bench = self.num_prefixes * self.prefix_len + self.num_prompts * self.suffix_len
        last = (
            self.system_len + self.first_len + (self.turns - 1) * (self.user_len + self.answer_len)
        )
        chat = self.system_len + self.conversations * (last - self.system_len)
        return {"device": self.num_blocks * self.block, "bench": bench, "chat": chat}

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of KV of ``tokens`` tokens (K and V, every layer), in bfloat16: the random model
        is saved in float32, and vLLM's ``auto`` dtype runs a float32 model in bfloat16 here."""
        return tokens * self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * 2

    def floor_blocks(self) -> int:
        """Device KV for the ``floor`` row: either workload's working set, and the blocks of
        every request it can run at once beside it."""
        most = max(self.working_set()["bench"], self.working_set()["chat"])
        per_request = -(-self.max_model_len // self.block)
        return -(-most // self.block) + self.concurrency * per_request


FULL = Shape(
    layers=8, hidden=512, heads=8, kv_heads=4, block=32, num_blocks=96, max_model_len=2048,
    prefix_len=1024, suffix_len=64, num_prefixes=8, num_prompts=64, concurrency=8, output_len=16,
    conversations=12, turns=4, system_len=256, first_len=512, user_len=64, answer_len=32,
    pool="1GiB",
)  # fmt: skip
QUICK = Shape(
    layers=4, hidden=256, heads=4, kv_heads=2, block=32, num_blocks=24, max_model_len=736,
    prefix_len=384, suffix_len=32, num_prefixes=4, num_prompts=16, concurrency=4, output_len=8,
    conversations=6, turns=3, system_len=128, first_len=192, user_len=32, answer_len=8,
    pool="256MiB",
)  # fmt: skip


def build_model(shape: Shape) -> str:
    """The random Llama of ``shape``, built once in the temporary folder; its path."""
    from kvflow.testing.models import build

    name = f"kvflow-serve-llama-{shape.layers}x{shape.hidden}"
    return str(
        build(f"{tempfile.gettempdir()}/{name}", layers=shape.layers, hidden=shape.hidden,
              heads=shape.heads, kv_heads=shape.kv_heads)
    )  # fmt: skip


# -- servers ---------------------------------------------------------------------------------


def start_rows(
    rows: list[str],
    shape: Shape,
    model: str,
    work: Path,
    stack: contextlib.ExitStack,
    pools: dict[str, dict[str, Any]] | None = None,
) -> dict[str, list[Server]]:
    """Every row's servers, started at once and waited for; stopped (and their pools and
    masters) when ``stack`` closes. ``pools`` gets each row's pool: ``socket`` (kvflow's
    shared pool, started by the first request) or ``master`` (its ``MooncakeMaster``)."""
    pools = {} if pools is None else pools
    servers: dict[str, list[Server]] = {}
    for row in rows:
        floor = row.endswith("floor")  # the floor's device KV
        connector = row.removesuffix("_floor")
        suffixed: dict[str, Any] = {}  # the settings a row's suffix names
        for suffix, setting, value in (
            ("_no_tails", "tail_chunks", False),
            ("_layer_saves", "deferred_saves", False),
            ("_across", "save_across_steps", True),
        ):
            if connector.endswith(suffix):
                suffixed[setting] = value
            connector = connector.removesuffix(suffix)
        env: dict[str, str] = {}
        transfer: dict[str, Any] | None = None
        count = 2 if row == "kvflow_two_servers" else 1
        chunk = CHUNK_ROW.fullmatch(row)
        part = PARTS.get(connector.removeprefix("kvflow_"), {}) if floor else {}
        if (
            connector in ("kvflow", "kvflow_two_servers")
            or chunk
            or part
            or row.startswith("kvflow_small")
        ):
            directory = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
            socket = f"{directory}/pool.sock"
            env["KVFLOW_POOL_SOCKET"] = socket
            pools[row] = {"socket": socket}
            stack.callback(shutil.rmtree, directory, ignore_errors=True)
            stack.callback(stop_pool, socket)  # first: callbacks run last to first
            extra: dict[str, Any] = {"chunk_blocks": int(chunk[1]) // shape.block} if chunk else {}
            extra.update(part)
            extra.update(suffixed)
            if row.startswith("kvflow_small_pool"):  # the pool starts itself, so small
                most = shape.kv_bytes(
                    max(shape.working_set()["bench"], shape.working_set()["chat"])
                )
                extra["shared"] = {"capacity": max(most // 2, 1 << 20)}
                if row.endswith("_disk"):
                    extra["shared"].update(disk_dir=f"{directory}/disk", disk_capacity=4 * most)
            transfer = kvflow_transfer_config(extra)
        elif connector == "kvflow_mooncake":
            pools[row] = {"master": stack.enter_context(MooncakeMaster())}
            master = pools[row]["master"].address
            extra = {**kvflow_mooncake_extra(master, shape.pool), **suffixed}
            transfer = kvflow_transfer_config(extra)
        elif connector == "mooncake_store_connector":
            pools[row] = {"master": stack.enter_context(MooncakeMaster())}
            master = pools[row]["master"].address
            segment = shape.pool.replace("iB", "B")  # Mooncake reads "1GB"
            env.update(mooncake_store_connector_env(work / f"{row}.json", master, segment))
            transfer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        args = serve_args(
            block_size=shape.block,
            num_blocks=shape.floor_blocks() if floor else shape.num_blocks,
            max_model_len=shape.max_model_len,
            max_num_seqs=shape.concurrency,
            kv_transfer_config=transfer,
        )
        servers[row] = []
        for n in range(count):
            server = Server(
                sys.executable, model, args, log=work / f"{row}{n}.log", env=env, cwd=str(REPO)
            )
            stack.callback(server.stop)
            servers[row].append(server)
    for row, group in servers.items():
        for server in group:
            server.ready()
        print(f"{row}: up", file=sys.stderr)
    return servers


SERVER_COUNTERS = {  # vLLM's counters a sample reads (and their labels), summed over servers
    "hit_tokens": ("vllm:external_prefix_cache_hits_total", {}),
    # per-request phases, seconds summed over the requests that finished: arrival to first
    # scheduled (waiting for device blocks among others), first scheduled to first token
    "queue_s": ("vllm:request_queue_time_seconds_sum", {}),
    "prefill_s": ("vllm:request_prefill_time_seconds_sum", {}),
    # prompt tokens vLLM computed, neither its prefix cache's nor the connector's (a load
    # that lets vLLM's cache serve the next request counts as fewer hit tokens, not as more
    # computed ones)
    "computed_tokens": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
}


def server_counters(servers: list[Server]) -> dict[str, float]:
    scraped = [s.metrics() for s in servers]
    return {
        key: sum(labelled(m, name, **labels) if labels else m.get(name, 0.0) for m in scraped)
        for key, (name, labels) in SERVER_COUNTERS.items()
    }


# -- workload: vLLM's client -----------------------------------------------------------------


class RoundRobinProxy:
    """An HTTP proxy on a free port, on a thread of its own: request n goes to upstream
    n mod len(upstreams), the response streamed back as it comes."""

    def __init__(self, upstreams: list[str]) -> None:
        self.upstreams = upstreams
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("the round-robin proxy did not start")

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._started.set()
        self._loop.run_forever()

    async def _forward(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        upstream = self.upstreams[self._next % len(self.upstreams)]
        self._next += 1
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        timeout = aiohttp.ClientTimeout(total=3600)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(
                request.method, upstream + request.path_qs, data=body, headers=headers
            ) as up,
        ):
            out = web.StreamResponse(status=up.status)
            out.content_type = up.content_type
            await out.prepare(request)
            async for data in up.content.iter_any():
                await out.write(data)
            await out.write_eof()
            return out

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)


def run_bench(url: str, shape: Shape, model: str, seed: int, work: Path) -> dict[str, Any]:
    """vLLM's client on ``prefix_repetition``: its JSON result (per request, with
    ``--save-detailed``: TTFTs and generated texts)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend", "vllm", "--base-url", url, "--model", MODEL_NAME, "--tokenizer", model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(shape.prefix_len),
            "--prefix-repetition-suffix-len", str(shape.suffix_len),
            "--prefix-repetition-num-prefixes", str(shape.num_prefixes),
            "--prefix-repetition-output-len", str(shape.output_len),
            "--num-prompts", str(shape.num_prompts), "--max-concurrency", str(shape.concurrency),
            "--request-rate", "inf", "--seed", str(seed), "--temperature", "0", "--ignore-eos",
            "--num-warmups", "0", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(work), "--result-filename", f"bench-{seed}-{free_port()}.json",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        ]
    )  # fmt: skip
    with open(work / "bench-client.log", "a") as log, contextlib.redirect_stdout(log):
        result: dict[str, Any] = bench_main(args)  # its report goes to the log
    return {
        "ttfts": list(result["ttfts"]),
        "outputs": list(result["generated_texts"]),
        "output_throughput": result["output_throughput"],
        "completed": result["completed"],
        "failed": result.get("failed", 0),
    }


# -- workload: multi-turn chat ---------------------------------------------------------------


def conversations(shape: Shape, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each conversation's user messages (token ids)."""
    rng = np.random.default_rng(seed)

    def words(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, VOCAB, n)]

    system = words(shape.system_len)
    chats = [
        [words(shape.first_len)] + [words(shape.user_len) for _ in range(shape.turns - 1)]
        for _ in range(shape.conversations)
    ]
    return system, chats


async def _stream(session: Any, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    sent = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            new = chunk_tokens(json.loads(line[6:]))
            if new and ttft is None:
                ttft = time.perf_counter() - sent
            tokens.extend(new)
    return {"ttft": ttft, "tokens": tokens}


async def _chat(urls: list[str], shape: Shape, seed: int) -> dict[str, Any]:
    import aiohttp

    system, chats = conversations(shape, seed)
    ttfts: list[float] = []
    outputs: dict[str, list[int]] = {}
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def conversation(c: int, messages: list[list[int]]) -> None:
            context = list(system)
            for turn, message in enumerate(messages):
                context += message
                url = urls[(c + turn) % len(urls)]  # two servers: every turn on the other one
                got = await _stream(session, url, context, shape.answer_len)
                ttfts.append(got["ttft"])
                outputs[f"{c}/{turn}"] = got["tokens"]
                context += got["tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(conversation(c, m) for c, m in enumerate(chats)))
        wall = time.perf_counter() - started
    total = sum(len(t) for t in outputs.values())
    ordered = [outputs[k] for k in sorted(outputs)]
    return {
        "ttfts": ttfts,
        "outputs": ordered,
        "output_throughput": total / wall,
        "completed": len(outputs),
        "failed": 0,
    }


def run_chat(urls: list[str], shape: Shape, seed: int) -> dict[str, Any]:
    return asyncio.run(_chat(urls, shape, seed))


# -- the run ---------------------------------------------------------------------------------


def row_cpu(group: list[Server], pool: dict[str, Any] | None) -> dict[str, float]:
    """CPU seconds the row's processes have used, per role (``cpu_by_role``), summed over its
    servers; ``pool_pid``: its pool process's pid (0: none, or not started yet)."""
    pid = pool_pid(pool) if pool else 0
    out: dict[str, float] = {"pool_pid": float(pid)}
    for n, server in enumerate(group):
        for what, seconds in cpu_by_role(server.proc.pid, pid if n == 0 else 0).items():
            out[what] = out.get(what, 0.0) + seconds
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """CPU seconds per role between two ``row_cpu`` readings; the pool's None where its
    process changed between them (started, or restarted)."""
    out: dict[str, float | None] = {
        k: after[k] - before[k] for k in after if k not in ("pool_pid", "pool")
    }
    same = before["pool_pid"] == after["pool_pid"]
    out["pool"] = after["pool"] - before["pool"] if same else None
    return out


def measure(
    servers: dict[str, list[Server]],
    shape: Shape,
    model: str,
    repeats: int,
    work: Path,
    pools: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Per repeat and workload: every row once, in a balanced order, on that repeat's prompts;
    with each sample, the CPU time the row's processes (and its pool's, from ``pools``) used."""
    pools = pools or {}
    rows = list(servers)
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {row: [] for row in rows} for w in WORKLOADS
    }
    proxies = {row: RoundRobinProxy([s.url for s in g]) for row, g in servers.items() if len(g) > 1}
    try:
        for i in range(repeats):
            for workload in WORKLOADS:
                for row in order(rows, i):
                    group = servers[row]
                    before = server_counters(group)
                    cpu_before = row_cpu(group, pools.get(row))
                    load = os.getloadavg()[0]
                    if workload == "bench":
                        url = (
                            f"http://127.0.0.1:{proxies[row].port}"
                            if row in proxies
                            else group[0].url
                        )
                        got = run_bench(url, shape, model, seed=1000 + i, work=work)
                    else:
                        got = run_chat([s.url for s in group], shape, seed=2000 + i)
                    after = server_counters(group)
                    got["cpu_s"] = cpu_used(cpu_before, row_cpu(group, pools.get(row)))
                    got.update({k: after[k] - before[k] for k in SERVER_COUNTERS})
                    got["loadavg_1m"] = load
                    got["position"] = order(rows, i).index(row)
                    samples[workload][row].append(got)
                    print(
                        f"repeat {i} {workload} {row}: mean TTFT "
                        f"{1e3 * statistics.mean(got['ttfts']):.1f} ms, "
                        f"hits {got['hit_tokens']:.0f}",
                        file=sys.stderr,
                    )
    finally:
        for proxy in proxies.values():
            proxy.close()
    return samples


def summarize(samples: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workload, rows in samples.items():
        table: dict[str, Any] = {}
        for row, runs in rows.items():
            ttfts = [t for r in runs for t in r["ttfts"]]
            if not ttfts:
                continue
            table[row] = {
                "requests": len(ttfts),
                "mean_ttft_ms": 1e3 * statistics.mean(ttfts),
                "median_ttft_ms": 1e3 * statistics.median(ttfts),
                "p99_ttft_ms": 1e3 * float(np.percentile(ttfts, 99)),
                "output_throughput": statistics.mean(r["output_throughput"] for r in runs),
                "hit_tokens": sum(r["hit_tokens"] for r in runs),
                "computed_tokens": sum(r.get("computed_tokens", float("nan")) for r in runs),
                # vLLM's own split of the time to first token, mean over requests
                "mean_queue_ms": phase_ms(runs, "queue_s", len(ttfts)),
                "mean_prefill_ms": phase_ms(runs, "prefill_s", len(ttfts)),
                "cpu_ms_per_request": cpu_ms(runs),
                "failed": sum(r["failed"] for r in runs),
                "outputs_differing_from_prefix_cache": differing(rows, row, "prefix_cache"),
                "outputs_differing_from_mooncake_store_connector": differing(
                    rows, row, "mooncake_store_connector"
                ),
            }
            for ref in ("mooncake_store_connector", "prefix_cache", "floor"):
                if ref in rows and ref != row:
                    for what, measure in RATIOS.items():
                        ratio = paired_ratio(runs, rows[ref], measure)
                        table[row][f"{what}_over_{ref}"] = ratio
        out[workload] = table
    return out


def phase_ms(runs: list[dict[str, Any]], key: str, requests: int) -> float | None:
    """Milliseconds of a request phase per request (None: a run that did not read it)."""
    if any(key not in r for r in runs):
        return None
    return 1e3 * sum(r[key] for r in runs) / requests


def differing(rows: dict[str, list[dict[str, Any]]], row: str, name: str) -> list[int] | None:
    """Per repeat: how many of ``row``'s requests gave other tokens than row ``name``'s on the
    same prompt."""
    ref = rows.get(name)
    if ref is None or any("outputs" not in r for r in rows[row] + ref):
        return None  # no such row, or a JSON kept without the outputs
    return [
        sum(x != y for x, y in zip(a["outputs"], b["outputs"], strict=False))
        + abs(len(a["outputs"]) - len(b["outputs"]))
        for a, b in zip(rows[row], ref, strict=False)
    ]


def cpu_ms(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    """CPU milliseconds per request of each of the row's processes (``cpu_by_role``) and
    ``total``, over the repeats whose sample read them all (None: none did)."""
    kept = [r for r in runs if "cpu_s" in r and r["cpu_s"]["pool"] is not None]
    if not kept:
        return None
    requests = sum(len(r["ttfts"]) for r in kept)
    out = {k: 1e3 * sum(r["cpu_s"][k] for r in kept) / requests for k in kept[0]["cpu_s"]}
    out["total"] = sum(out.values())
    return out


def cpu_per_request(r: dict[str, Any]) -> float:
    """One sample's CPU seconds per request, every process of the row and its pool; NaN where
    the pool's was not read."""
    cpu = r.get("cpu_s")
    if not cpu or cpu["pool"] is None or not r["ttfts"]:
        return float("nan")
    return sum(cpu.values()) / len(r["ttfts"])


CPU_REFS = ("mooncake_store_connector", "prefix_cache", "floor")
RATIOS = {  # per repeat, a row's figure over the reference row's
    "mean_ttft": lambda r: statistics.mean(r["ttfts"]),
    "p99_ttft": lambda r: float(np.percentile(r["ttfts"], 99)),
    "throughput": lambda r: r["output_throughput"],
    "cpu": cpu_per_request,
}


def paired_ratio(
    runs: list[dict[str, Any]], ref: list[dict[str, Any]], measure: Any
) -> float | None:
    """``measure`` of each repeat over the reference's in the same repeat (run minutes apart
    at most), median over the repeats."""
    pairs = [
        measure(a) / measure(b)
        for a, b in zip(runs, ref, strict=False)
        if a["ttfts"] and b["ttfts"]
    ]
    pairs = [x for x in pairs if not np.isnan(x)]  # a sample without its CPU reading
    return statistics.median(pairs) if pairs else None


def print_table(summary: dict[str, Any]) -> None:
    for workload, table in summary.items():
        print(
            f"{workload:26} {'mean ms':>9} {'median':>9} {'p99':>9} {'out tok/s':>10} "
            f"{'hit tok':>9} {'computed':>9} {'queue ms':>9} {'prefill':>8} {'mean/msc':>9} "
            f"{'p99/msc':>8} {'tput/msc':>8} {'mean/pc':>8} "
            "differing from pc, msc"
        )
        for row, r in table.items():

            def ratio(key: str, r: dict[str, Any] = r) -> str:
                v = r.get(key)
                return f"{v:.3f}" if isinstance(v, float) else "-"

            def ms(key: str, r: dict[str, Any] = r) -> str:
                v = r.get(key)
                return f"{v:.1f}" if isinstance(v, float) else "-"

            print(
                f"{row:26} {r['mean_ttft_ms']:9.1f} {r['median_ttft_ms']:9.1f} "
                f"{r['p99_ttft_ms']:9.1f} {r['output_throughput']:10.1f} {r['hit_tokens']:9.0f} "
                f"{r.get('computed_tokens', float('nan')):9.0f} "
                f"{ms('mean_queue_ms'):>9} {ms('mean_prefill_ms'):>8} "
                f"{ratio('mean_ttft_over_mooncake_store_connector'):>9} "
                f"{ratio('p99_ttft_over_mooncake_store_connector'):>8} "
                f"{ratio('throughput_over_mooncake_store_connector'):>8} "
                f"{ratio('mean_ttft_over_prefix_cache'):>8} "
                f"{r['outputs_differing_from_prefix_cache']} "
                f"{r['outputs_differing_from_mooncake_store_connector']}"
            )
        print()
        print(
            f"{workload + ' CPU ms per request':26} {'api':>8} {'engine':>8} {'worker':>8} "
            f"{'pool':>8} {'total':>8} {'cpu/msc':>8} {'cpu/pc':>8} {'cpu/floor':>9}"
        )
        for row, r in table.items():
            cpu = r.get("cpu_ms_per_request") or {}
            cells = [cpu.get(k) for k in ("api", "engine", "worker", "pool", "total")]
            cells += [r.get(f"cpu_over_{ref}") for ref in CPU_REFS]
            print(
                f"{row:26} "
                + " ".join(f"{v:8.3f}" if v is not None else f"{'-':>8}" for v in cells)
            )
        print()


def plot(summary: dict[str, Any], path: str) -> str | None:
    """Mean/median/p99 TTFT per row, one panel per workload; a note instead without
    matplotlib."""
    from kvflow.bench.plots import figure, save
    from kvflow.errors import MissingDependencyError

    try:
        fig, axes = figure(1, len(summary), figsize=(6 * len(summary), 4), squeeze=False)
    except MissingDependencyError as exc:
        return f"no plot: {exc}"
    for ax, (workload, table) in zip(axes[0], summary.items(), strict=True):
        rows = list(table)
        x = np.arange(len(rows))
        for k, key in enumerate(("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")):
            ax.bar(x + (k - 1) * 0.27, [table[r][key] for r in rows], 0.27, label=key[:-8])
        ax.set_xticks(x, rows, rotation=20, ha="right")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(workload)
        ax.legend()
    save(fig, path)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--json", default=str(OUT / "vllm_serve.json"))
    parser.add_argument("--plot", default=None, help="a PNG of the TTFTs (needs matplotlib)")
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="run nothing: summarize (and --plot) the samples of an earlier run's JSON, e.g. "
        "with an interpreter that has matplotlib",
    )
    args = parser.parse_args()
    if args.from_json:
        summary = summarize(json.loads(Path(args.from_json).read_text())["samples"])
        print_table(summary)
        if args.plot:
            print(plot(summary, args.plot) or f"plot: {args.plot}", file=sys.stderr)
        return 0
    rows = args.rows.split(",")
    repeats = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    shape = QUICK if args.quick else FULL
    unknown = sorted(
        row
        for row in set(rows) - set(ROWS) - set(ON_REQUEST)
        if not (m := CHUNK_ROW.fullmatch(row)) or int(m[1]) % shape.block
    )
    if unknown:
        parser.error(
            f"unknown rows {unknown}; known: {', '.join(ROWS + ON_REQUEST)}, and kvflow_chunkN "
            f"for N a multiple of the block size {shape.block}"
        )
    model = build_model(shape)
    work = Path(tempfile.mkdtemp(prefix="kvserve-", dir="/tmp"))
    started = time.monotonic()
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        pools: dict[str, dict[str, Any]] = {}
        servers = start_rows(rows, shape, model, work, stack, pools)
        samples = measure(servers, shape, model, repeats, work, pools)
    summary = summarize(samples)
    document = {
        "summary": summary,
        "samples": samples,
        "shape": shape.__dict__,
        "working_set_tokens": shape.working_set(),
        "repeats": repeats,
        "rows": rows,
    }
    write_report(args.json, document, started=started, load_before=load_before, work=work)
    print_table(summary)
    if args.plot:
        note = plot(summary, args.plot)
        print(note or f"plot: {args.plot}", file=sys.stderr)
    print(f"JSON: {args.json}; logs: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
