"""Does a layer-by-layer save slow the model thread beyond the time it spends in kvflow's calls?

    .venv/bin/python benchmarks/save_interference.py [--rounds N] [--steps N] [--json PATH]

A stand-in for vLLM's CPU model thread, without vLLM: one thread pinned to the first CPU of this
process's set, one torch thread, each step 8 "layers" of small torch ops (a small model's
forward: many ops, Python between them). Per step with saves on, a ``SyncTransferEngine`` saves
two new 64-token chunks of a ``kv_split`` cache (8 layers, 4 KV heads x 64, float32) as the
vLLM connector does: ``start_save`` at the step's start, ``layer_written`` after each layer,
``wait`` at its end, to a ``kvflow serve`` pool this script starts on a private socket (64 MiB,
filled during the warm-up, so saves evict as in a long run), pinned with the copy thread and the
engine's loop to the second CPU (vLLM's reserved core). Five modes per round, their order
rotated every round: saves off; saves through the copy thread (``inline_saves=False``,
``deferred_saves=False``: the loop and the copy thread handle each layer as it comes); deferred
saves (``inline_saves=False``: what a store whose save may wait, Mooncake's, gets: the layers
handed to the loop and the copy thread together after the last); inline saves (the default:
each layer copied in ``layer_written`` on the model thread, the loop woken once after the
last, through the copies the store checked when the save opened, ``Store.prepare_writes``);
and ``inline_checked``, inline saves through one ``batch_copy`` a layer that checks its ranges
(the store behind a ``StoreWrapper``, which offers no prepared copies). Per round and mode
the median step time, whole and outside kvflow's calls, and the model thread's voluntary context
switches per step; ratios over saves off per round, and their median. A control runs a busy
process on the second CPU instead: the figure the machine's own sharing gives. Needs 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kvflow
from kvflow.pool.launch import wait_until_serving
from kvflow.stores.wrapper import StoreWrapper

REPO = Path(__file__).resolve().parent.parent
LAYERS, BLOCKS, BLOCK = 8, 512, 32


def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x
    for _ in range(12):
        h = torch.nn.functional.silu(h @ w) * 0.01 + h
    return h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default=str(REPO / "bench-results" / "save_interference.json"))
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("needs 2 CPUs", file=sys.stderr)
        return 2
    model_cpu, spare = cpus[0], cpus[1]
    directory = tempfile.mkdtemp(prefix="kvsi-")
    socket = f"{directory}/pool.sock"
    command = [sys.executable, "-m", "kvflow", "serve", "--socket", socket]
    server = subprocess.Popen(
        [*command, "--capacity", "64MiB", "--cpus", str(spare)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_serving(socket, 60.0, server)
        result = measure(socket, model_cpu, spare, args.rounds, args.steps)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        for name in os.listdir(directory):
            os.unlink(f"{directory}/{name}")
        os.rmdir(directory)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print("median over rounds of (mode's median step / saves off's), and the ms medians:")
    for mode in MODES[1:]:
        r = result["modes"][mode]
        rounds = ", ".join(f"{x:.2f}" for x in r["step_ratios"])
        print(
            f"  {mode:14s} whole step {r['step_ratio']:.3f} ({r['step_ms']:.2f} ms against "
            f"{result['off_ms']:.2f}), outside kvflow's calls {r['outside_ratio']:.3f}, "
            f"in them {r['inside_ms']:.2f} ms, {r['switches_per_step']:.1f} sleeps of the "
            f"model thread a step ({result['off_switches_per_step']:.1f} with saves off); "
            f"per round {rounds}"
        )
    print(f"a busy process on CPU {spare} instead of saves: {result['control_ratio']:.3f}")
    print(f"JSON: {args.json}")
    return 0


MODES = ("off", "thread", "deferred", "inline", "inline_checked")


def measure(socket: str, model_cpu: int, spare: int, rounds: int, steps: int) -> dict:
    os.sched_setaffinity(0, {model_cpu})
    torch.set_num_threads(1)
    caches = [torch.randn(2, BLOCKS, BLOCK, 4, 64) for _ in range(LAYERS)]
    layout = kvflow.KVLayout.from_kv_split_tensors(caches, block_size=BLOCK)
    store = kvflow.SharedStore(socket=socket)
    engines = {
        mode: kvflow.SyncTransferEngine(
            layout,
            StoreWrapper(store) if mode == "inline_checked" else store,
            kvflow.EngineConfig(
                model=f"si{os.getpid()}",
                chunk_blocks=2,
                copy_cpus=(spare,),
                inline_saves=mode not in ("thread", "deferred"),
                deferred_saves=mode == "deferred",
            ),
        )
        for mode in MODES[1:]
    }
    x, w = torch.randn(64, 512), torch.randn(512, 512)
    rng = np.random.default_rng(0)

    def step(mode: str) -> tuple[float, float]:
        """The step's time, whole and inside kvflow's calls."""
        inside, begun = 0.0, time.perf_counter()
        handle = None
        if mode != "off":
            tokens = rng.integers(0, 1 << 30, 128)  # new tokens: two chunks no one stored
            blocks = rng.choice(BLOCKS, 4, replace=False)
            t = time.perf_counter()
            handle = engines[mode].start_save([(tokens, blocks)])
            inside += time.perf_counter() - t
        for i in range(LAYERS):
            layer(x, w)
            if handle is not None:
                t = time.perf_counter()
                handle.layer_written(i)
                inside += time.perf_counter() - t
        if handle is not None:
            t = time.perf_counter()
            handle.wait()
            inside += time.perf_counter() - t
        return time.perf_counter() - begun, inside

    def rounds_of(n: int) -> dict[str, list[tuple[float, float, float, float]]]:
        """Per mode, per round: median step, median outside kvflow's calls, median inside, and
        the model thread's voluntary context switches per step (each a sleep: on the GIL, or
        in a wait of kvflow's)."""
        out: dict[str, list[tuple[float, float, float, float]]] = {mode: [] for mode in MODES}
        for r in range(n):
            for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
                times = [step(mode) for _ in range(steps)]
                switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - switches
                out[mode].append(
                    (
                        statistics.median(t for t, _ in times),
                        statistics.median(t - i for t, i in times),
                        statistics.median(i for _, i in times),
                        switches / steps,
                    )
                )
        return out

    try:
        rounds_of(1)  # warm-up: fills the pool
        per = rounds_of(rounds)
        busy = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os\nos.sched_setaffinity(0, {{{spare}}})\nwhile True: pass",
            ]
        )
        try:
            base = [statistics.median(step("off")[0] for _ in range(steps)) for _ in range(4)]
        finally:
            busy.kill()
            busy.wait()
        alone = [statistics.median(step("off")[0] for _ in range(steps)) for _ in range(4)]
    finally:
        for engine in engines.values():
            engine.close()
        store.close()
    off = per["off"]
    modes = {}
    for mode in MODES[1:]:
        rows = per[mode]
        step_ratios = [m[0] / o[0] for m, o in zip(rows, off, strict=True)]
        outside_ratios = [m[1] / o[1] for m, o in zip(rows, off, strict=True)]
        modes[mode] = {
            "step_ms": 1e3 * statistics.median(m[0] for m in rows),
            "outside_ms": 1e3 * statistics.median(m[1] for m in rows),
            "inside_ms": 1e3 * statistics.median(m[2] for m in rows),
            "step_ratio": statistics.median(step_ratios),
            "outside_ratio": statistics.median(outside_ratios),
            "switches_per_step": statistics.median(m[3] for m in rows),
            "step_ratios": step_ratios,
            "outside_ratios": outside_ratios,
        }
    return {
        "off_ms": 1e3 * statistics.median(o[0] for o in off),
        "off_switches_per_step": statistics.median(o[3] for o in off),
        "modes": modes,
        "control_ratio": statistics.median(base) / statistics.median(alone),
        "rounds": rounds,
        "steps": steps,
        "cpus": {"model": model_cpu, "spare": spare},
    }


if __name__ == "__main__":
    sys.exit(main())
