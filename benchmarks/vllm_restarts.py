"""The pool restarting under a steady ``vllm serve`` load: how long time to first token takes to
come back, and whether any request fails or answers differently.

    $KVFLOW_VLLM_PYTHON benchmarks/vllm_restarts.py [--rows a,b] [--seconds S] [--repeats N]
        [--json PATH]

One server at a time, alone on the machine, vLLM's defaults (its prefix cache on) with device
KV for two or three of the concurrent prompts; ``CONCURRENCY`` clients send requests back to
back for ``--seconds`` (prompts over ``PREFIXES`` shared prefixes of ``PREFIX_TOKENS``, each with
its own suffix; greedy, float32, ``tests/support/restarts.py``), ``/metrics`` scraped every
100 ms. At a third and at two thirds of the run the pool restarts:

* ``kvflow`` (KVFlowConnector on its defaults, the shared pool it starts itself on a private
  socket): ``kvflow pool stop``, then a SIGKILL of the server a client started since;
* ``kvflow_disk``: the same, the pool with a disk tier (``DISK_CAPACITY`` in the socket's
  private folder), so that the server started after each fault serves what the disk holds;
* ``kvflow_mooncake`` and ``mooncake_store_connector`` (vLLM's own): the ``mooncake_master``
  killed, and started again at its address ``HOLD_S`` later; both times.

A ``reference`` server without a connector answers every prompt sent afterwards. Per row:
requests, failed requests, answers differing from the reference's, the steady TTFT (median of
the requests sent in the 10 s before the first restart), and per restart the seconds until TTFT
is back (the first 2 s window of requests, sliding by 0.25 s, whose median is within 10 % of
steady), the mean TTFT of the 5 s after it against steady, and the scrapes' problems (errors,
counters going down).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvflow.stores.mooncake.master import MooncakeMaster

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the serving helpers are shared with the tests
from tests.support.restarts import Scraper, ask, kill_pool_server, prompt  # noqa: E402
from tests.support.serve import (  # noqa: E402
    Server,
    kvflow_mooncake_extra,
    kvflow_transfer_config,
    mooncake_store_connector_env,
    serve_args,
    stop_pool,
    stream_completion,
    write_report,
)

ROWS = ("kvflow", "kvflow_disk", "kvflow_mooncake", "mooncake_store_connector")
DISK_CAPACITY = "4GiB"
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS = 6, 1024, 64
CONCURRENCY = 4
MAX_TOKENS = 8
HOLD_S = 1.0  # a master stays dead this long
STEADY_S = 10.0  # steady TTFT: the requests sent in this long before the first restart
WINDOW_S, STEP_S, WITHIN = 2.0, 0.25, 1.10
SHAPE = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4}
ARGS = {"block_size": 32, "num_blocks": 96, "max_model_len": 2048, "max_num_seqs": CONCURRENCY}
OUT = REPO / "bench-results"


def the_prompt(i: int) -> list[int]:
    return prompt(i, PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS)


def start(row: str, model: str, work: Path, stack: contextlib.ExitStack) -> tuple[Server, Any]:
    """The row's server, up; and its two faults."""
    env: dict[str, str] = {}
    transfer: dict[str, Any] | None = None
    faults: tuple[Callable[[], object], ...] = ()
    if row in ("kvflow", "kvflow_disk"):
        directory = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
        socket = f"{directory}/pool.sock"
        env["KVFLOW_POOL_SOCKET"] = socket
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        stack.callback(kill_pool_server, socket)
        stack.callback(stop_pool, socket)
        disk = {"disk_dir": f"{directory}/disk", "disk_capacity": DISK_CAPACITY}
        transfer = kvflow_transfer_config({"shared": disk} if row == "kvflow_disk" else {})
        faults = (lambda: stop_pool(socket), lambda: kill_pool_server(socket, 60.0))
    elif row in ("kvflow_mooncake", "mooncake_store_connector"):
        master = stack.enter_context(MooncakeMaster(log=str(work / f"{row}-master.log")))

        def restart() -> None:
            master.stop()
            time.sleep(HOLD_S)
            master.start()

        faults = (restart, restart)
        if row == "kvflow_mooncake":
            transfer = kvflow_transfer_config(kvflow_mooncake_extra(master.address, "1GiB"))
        else:
            env.update(mooncake_store_connector_env(work / f"{row}.json", master.address, "1GB"))
            transfer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    args = [*serve_args(**ARGS, kv_transfer_config=transfer), "--dtype", "float32"]
    server = Server(sys.executable, model, args, log=work / f"{row}.log", env=env, cwd=str(REPO))
    stack.callback(server.stop)
    server.ready()
    return server, faults


def drive(server: Server, seconds: float, faults: tuple[Callable[[], object], ...]) -> dict:
    """Requests back to back from ``CONCURRENCY`` threads for ``seconds``; the faults at a
    third and two thirds of it. Every request's send time (from the start), TTFT, tokens or
    error."""
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    counter = iter(range(10**9))
    t0 = time.monotonic()
    end = t0 + seconds

    def client() -> None:
        while time.monotonic() < end:
            with lock:
                i = next(counter)
            sent = time.monotonic() - t0
            try:
                out = stream_completion(server.url, the_prompt(i), max_tokens=MAX_TOKENS)
                record = {"i": i, "sent": sent, "ttft_s": out["ttft_s"], "tokens": out["tokens"]}
            except (OSError, RuntimeError) as exc:
                record = {"i": i, "sent": sent, "error": f"{type(exc).__name__}: {exc}"}
            with lock:
                records.append(record)

    made = []
    with Scraper(server) as scraper:
        threads = [threading.Thread(target=client, daemon=True) for _ in range(CONCURRENCY)]
        for thread in threads:
            thread.start()
        for n, fault in enumerate(faults):
            time.sleep(max(0.0, t0 + seconds * (n + 1) / 3 - time.monotonic()))
            at = time.monotonic() - t0
            fault()
            made.append({"at_s": round(at, 3), "took_s": round(time.monotonic() - t0 - at, 3)})
        for thread in threads:
            thread.join(seconds + 300)
    hits = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    return {
        "records": sorted(records, key=lambda r: r["i"]),
        "faults": made,
        "scrapes": len(scraper.scrapes),
        "scrape_errors": scraper.errors,
        "scrape_problems": scraper.problems(),
        "hit_tokens": hits,
    }


def recovery(records: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Steady TTFT and, per fault, the seconds until a window's median is back within 10 %."""
    ok = [r for r in records if "ttft_s" in r]
    first = faults[0]["at_s"] if faults else max(r["sent"] for r in ok)
    steady = statistics.median(
        [r["ttft_s"] for r in ok if first - STEADY_S <= r["sent"] < first] or [float("nan")]
    )
    out: dict[str, Any] = {"steady_ms": round(1000 * steady, 1), "restarts": []}
    for n, fault in enumerate(faults):
        start = fault["at_s"]
        stop = faults[n + 1]["at_s"] if n + 1 < len(faults) else max(r["sent"] for r in ok)
        back = None
        t = start
        while t + WINDOW_S <= stop + 1e-9:
            window = [r["ttft_s"] for r in ok if t <= r["sent"] < t + WINDOW_S]
            if window and statistics.median(window) <= WITHIN * steady:
                back = round(t - start, 2)
                break
            t += STEP_S
        after = [r["ttft_s"] for r in ok if start <= r["sent"] < start + 5.0]
        out["restarts"].append(
            {
                "back_s": back,
                "mean_5s_ms": round(1000 * statistics.fmean(after), 1) if after else None,
                "mean_5s_over_steady": round(statistics.fmean(after) / steady, 2)
                if after
                else None,
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--seconds", type=float, default=60.0, help="each row's run (60)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each row (2)")
    parser.add_argument("--json", default=str(OUT / "vllm_restarts.json"))
    args = parser.parse_args()
    rows = args.rows.split(",")
    if unknown := sorted(set(rows) - set(ROWS)):
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if args.seconds < 3 * STEADY_S or args.repeats < 1:
        parser.error(f"--seconds must be >= {3 * STEADY_S:g} and --repeats >= 1")
    from kvflow.testing.models import build

    name = f"kvflow-serve-llama-{SHAPE['layers']}x{SHAPE['hidden']}"
    model = str(build(f"{tempfile.gettempdir()}/{name}", **SHAPE))
    work = Path(tempfile.mkdtemp(prefix="kvrestarts-", dir="/tmp"))
    started, load_before = time.monotonic(), os.getloadavg()
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for row in rows if repeat % 2 == 0 else rows[::-1]:
            print(f"{row}: repeat {repeat + 1}", file=sys.stderr)
            with contextlib.ExitStack() as stack:
                server, faults = start(row, model, work, stack)
                ask(server.url, range(10**6, 10**6 + 2), prompts=the_prompt)  # warm-up
                runs.append({"row": row, "repeat": repeat, **drive(server, args.seconds, faults)})
    last = max(r["i"] for run in runs for r in run["records"])
    print(f"reference: {last + 1} prompts", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        server, _ = start("reference", model, work, stack)
        reference = {a.index: a.tokens for a in ask_all(server.url, last + 1)}
    table = []
    for run in runs:
        records = run["records"]
        failed = [r for r in records if "error" in r]
        differing = [r["i"] for r in records if "tokens" in r and r["tokens"] != reference[r["i"]]]
        summary = recovery(records, run["faults"])
        run.update(failed=len(failed), differing=len(differing), **summary)
        table.append(run)
        print(
            f"{run['row']:26s} r{run['repeat']}  requests {len(records):4d}  failed "
            f"{len(failed)}  differing {len(differing)}  steady {summary['steady_ms']:7.1f} ms  "
            + "  ".join(
                f"back {x['back_s']} s, 5 s mean x{x['mean_5s_over_steady']}"
                for x in summary["restarts"]
            )
            + f"  scrape problems {len(run['scrape_errors']) + len(run['scrape_problems'])}"
        )
    for run in runs:  # the tokens are compared; the JSON keeps the times
        for r in run["records"]:
            r.pop("tokens", None)
    document = {"runs": runs, "rows": rows, "seconds": args.seconds, "shape": SHAPE, **ARGS}
    write_report(args.json, document, started=started, load_before=load_before, work=work)
    print(f"JSON: {args.json}; logs: {work}", file=sys.stderr)
    return 0


def ask_all(url: str, count: int) -> list[Any]:
    """Every prompt ``0 .. count - 1``, ``CONCURRENCY`` at a time, as the rows sent them."""
    return ask(url, range(count), prompts=the_prompt)


if __name__ == "__main__":
    sys.exit(main())
