"""A long replay: ``vllm serve`` answering for ``--minutes`` a workload of many distinct prefixes
that keeps every pool evicting, with the resident memory of every process sampled, kvflow beside
vLLM's MooncakeStoreConnector.

    $KVFLOW_VLLM_PYTHON benchmarks/vllm_replay.py [--rows kvflow,kvflow_mooncake,...]
        [--minutes 30] [--json PATH]

Every row's server runs at once (``vllm_serve.start_rows``: vLLM's defaults, its prefix cache
on; device KV ``SHAPE.num_blocks`` blocks of 32; each pool 1 GiB: kvflow's shared pool on its
defaults, started by the connector on a private socket; each Mooncake segment, with a master
per row; the answers' tokens are not compared here), each driven by ``CLIENTS``
clients sending back to back. Request ``n`` of a row: a ``PREFIX_TOKENS``-token prefix, half
the time a new one (never seen before) and otherwise one of the last ``RECENT`` new ones,
then its own ``SUFFIX_TOKENS``; ``MAX_TOKENS`` out. A new prefix's KV is ~4.3 MiB (bfloat16, as
vLLM runs the model): every pool is full after the first ~240 and evicts from then on, and the
device's cache holds a few.

Every ``SAMPLE_S`` seconds: the resident memory (``VmRSS``, and ``RssAnon``: the heap, without
the pool's shared pages) of every process of each row's ``vllm serve`` (its process group: API
server, engine core, worker), summed and the largest, and of the row's pool process (``kvflow
serve``; ``mooncake_master``), and the requests answered so far. Per row and process
kind: RSS at the end of the warm-up (the first third of the run) and at the end, and the slope
after warm-up, a least-squares line of RSS against requests answered, in MiB per 1,000
requests; failed requests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from vllm_serve import Shape, build_model, start_rows

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the serving helpers are shared with the tests
from tests.support.serve import (  # noqa: E402
    Server,
    chosen_rows,
    group,
    pool_pid,
    stream_completion,
    write_report,
)

ROWS = ("kvflow", "kvflow_mooncake", "mooncake_store_connector")
SHAPE = Shape(
    layers=8, hidden=512, heads=8, kv_heads=4, block=32, num_blocks=96, max_model_len=1024,
    prefix_len=0, suffix_len=0, num_prefixes=0, num_prompts=0, concurrency=4, output_len=0,
    conversations=0, turns=0, system_len=0, first_len=0, user_len=0, answer_len=0, pool="1GiB",
)  # fmt: skip
PREFIX_TOKENS, SUFFIX_TOKENS, MAX_TOKENS = 512, 32, 4
RECENT = 32
CLIENTS = 2
SAMPLE_S = 10.0
OUT = REPO / "bench-results"
KEYS = ("vllm_mib", "vllm_anon_mib", "vllm_largest_mib", "pool_mib", "pool_anon_mib")


def replay_prompt(row_seed: int, n: int) -> list[int]:
    """Request ``n``'s tokens: a new prefix for even draws, else one of the last ``RECENT``."""
    draw = np.random.default_rng([row_seed, n])
    new = n // 2  # prefixes made new so far (about half the requests)
    prefix = new if draw.random() < 0.5 else max(0, new - int(draw.integers(1, RECENT + 1)))
    head = np.random.default_rng([row_seed, 10**9, prefix]).integers(3, 1024, PREFIX_TOKENS)
    tail = draw.integers(3, 1024, SUFFIX_TOKENS)
    return [int(t) for t in np.concatenate([head, tail])]


def rss_mib(pid: int) -> dict[str, float]:
    """A process's resident memory in MiB: ``rss`` (VmRSS), ``anon`` (RssAnon: its heap, what
    a leak grows; the rest is files and shared memory such as a pool's arena or a Mooncake
    segment, whose pages count as they are first touched). Zeros: gone."""
    out = {"rss": 0.0, "anon": 0.0}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key = {"VmRSS:": "rss", "RssAnon:": "anon"}.get(line.split(":")[0] + ":")
            if key:
                out[key] = int(line.split()[1]) / 1024
    return out


class Row:
    """One row's clients, counters and memory samples."""

    def __init__(self, name: str, seed: int, server: Server, pool: dict[str, Any]) -> None:
        self.name, self.seed, self.server, self.pool = name, seed, server, pool
        self.answered = self.failed = 0
        self.samples: list[dict[str, Any]] = []
        self._next = 0
        self._lock = threading.Lock()

    def client(self, end: float) -> None:
        while time.monotonic() < end:
            with self._lock:
                n, self._next = self._next, self._next + 1
            try:
                stream_completion(
                    self.server.url, replay_prompt(self.seed, n), max_tokens=MAX_TOKENS
                )
                ok = True
            except (OSError, RuntimeError):
                ok = False
            with self._lock:
                self.answered += ok
                self.failed += not ok

    def sample(self, t: float) -> None:
        vllm = [rss_mib(pid) for pid in group(self.server.proc.pid)]
        pid = pool_pid(self.pool)
        pool = rss_mib(pid) if pid else None
        self.samples.append(
            {
                "t_s": round(t, 1),
                "answered": self.answered,
                "vllm_mib": round(sum(m["rss"] for m in vllm), 1),
                "vllm_anon_mib": round(sum(m["anon"] for m in vllm), 1),
                "vllm_largest_mib": round(max((m["rss"] for m in vllm), default=0.0), 1),
                "pool_mib": round(pool["rss"], 1) if pool else None,
                "pool_anon_mib": round(pool["anon"], 1) if pool else None,
            }
        )


def slope(samples: list[dict[str, Any]], key: str, since_s: float) -> float | None:
    """MiB per 1,000 requests answered, least squares over the samples from ``since_s``."""
    points = [(s["answered"], s[key]) for s in samples if s["t_s"] >= since_s and s[key]]
    if len(points) < 3 or points[-1][0] == points[0][0]:
        return None
    x, y = np.array(points, dtype=float).T
    return round(float(np.polyfit(x / 1000, y, 1)[0]), 3)


def summarize(row: Row, warmup_s: float) -> dict[str, Any]:
    at_warmup = next((s for s in row.samples if s["t_s"] >= warmup_s), row.samples[-1])
    last = row.samples[-1]
    out: dict[str, Any] = {"answered": row.answered, "failed": row.failed}
    for key in KEYS:
        out[key] = {
            "at_warmup": at_warmup[key],
            "at_end": last[key],
            "slope_mib_per_1000": slope(row.samples, key, warmup_s),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--minutes", type=float, default=30.0, help="the replay's length (30)")
    parser.add_argument("--json", default=str(OUT / "vllm_replay.json"))
    args = parser.parse_args()
    rows = chosen_rows(parser, args.rows, ROWS)
    if args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    model = build_model(SHAPE)
    work = Path(tempfile.mkdtemp(prefix="kvreplay-", dir="/tmp"))
    started, load_before = time.monotonic(), os.getloadavg()
    seconds = 60 * args.minutes
    with contextlib.ExitStack() as stack:
        pools: dict[str, dict[str, Any]] = {}
        servers = start_rows(rows, SHAPE, model, work, stack, pools)
        replays = [Row(r, i, servers[r][0], pools[r]) for i, r in enumerate(rows)]
        t0 = time.monotonic()
        end = t0 + seconds
        threads = [
            threading.Thread(target=row.client, args=(end,), daemon=True)
            for row in replays
            for _ in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        while time.monotonic() < end:
            for row in replays:
                row.sample(time.monotonic() - t0)
            print(
                f"{time.monotonic() - t0:7.0f} s  "
                + "  ".join(f"{r.name} {r.samples[-1]}" for r in replays),
                file=sys.stderr,
            )
            time.sleep(max(0.0, min(SAMPLE_S, end - time.monotonic())))
        for thread in threads:
            thread.join(300)
        for row in replays:
            row.sample(time.monotonic() - t0)
    warmup_s = seconds / 3
    summary = {row.name: summarize(row, warmup_s) for row in replays}
    document = {
        "summary": summary,
        "samples": {row.name: row.samples for row in replays},
        "minutes": args.minutes,
        "warmup_s": warmup_s,
        "shape": SHAPE.__dict__,
        "prefix_tokens": PREFIX_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "recent": RECENT,
        "clients": CLIENTS,
        "rows": rows,
    }
    write_report(args.json, document, started=started, load_before=load_before, work=work)
    for name, s in summary.items():
        print(
            f"{name:26s} answered {s['answered']:6d} failed {s['failed']:3d}  "
            + "  ".join(
                f"{k} {s[k]['at_warmup']} -> {s[k]['at_end']} "
                f"({s[k]['slope_mib_per_1000']} MiB/1000)"
                for k in KEYS
            )
        )
    print(f"JSON: {args.json}; logs: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
