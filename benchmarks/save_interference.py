"""Does a layer-by-layer save slow the model thread beyond the time it spends in kvflow's calls?

    .venv/bin/python benchmarks/save_interference.py [--rounds N] [--steps N] [--json PATH]

A stand-in for vLLM's CPU model thread, without vLLM: one thread pinned to the first CPU of this
process's set, one torch thread, each step 8 "layers" of small torch ops (a small model's
forward: many ops, Python between them). Per step with saves on, a ``SyncTransferEngine`` saves
two new 64-token chunks of a ``kv_split`` cache (8 layers, 4 KV heads x 64, float32) as the
vLLM connector does: ``start_save`` at the step's start, ``layer_written`` after each layer,
``wait`` at its end, to a ``kvflow serve`` pool this script starts on a private socket, pinned
with the copy threads and the engine's loop to the second CPU (vLLM's reserved core). Rounds
of ``--steps`` steps alternate saves off and on (the order swapped every round); per round the
median step time outside kvflow's calls, and the ratio on/off per round and over all rounds.
A control runs a busy process on the second CPU instead: the figure the machine's own sharing
gives. Needs 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
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
        [*command, "--capacity", "256MiB", "--cpus", str(spare)],
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
    print(
        f"model thread's step outside kvflow's calls, median: saves off {result['off_ms']:.2f} ms, "
        f"on {result['on_ms']:.2f} ms, on/off {result['ratio']:.3f} (per round "
        f"{', '.join(f'{r:.2f}' for r in result['ratios'])}); in kvflow's calls "
        f"{result['inside_ms']:.2f} ms a saving step; a busy process on CPU {spare} instead: "
        f"{result['control_ratio']:.3f}\nJSON: {args.json}"
    )
    return 0


def measure(socket: str, model_cpu: int, spare: int, rounds: int, steps: int) -> dict:
    os.sched_setaffinity(0, {model_cpu})
    torch.set_num_threads(1)
    caches = [torch.randn(2, BLOCKS, BLOCK, 4, 64) for _ in range(LAYERS)]
    layout = kvflow.KVLayout.from_kv_split_tensors(caches, block_size=BLOCK)
    store = kvflow.SharedStore(socket=socket)
    config = kvflow.EngineConfig(model=f"si{os.getpid()}", chunk_blocks=2, copy_cpus=(spare,))
    engine = kvflow.SyncTransferEngine(layout, store, config)
    x, w = torch.randn(64, 512), torch.randn(512, 512)
    rng = np.random.default_rng(0)

    def step(save: bool) -> tuple[float, float]:
        inside, begun = 0.0, time.perf_counter()
        handle = None
        if save:
            tokens = rng.integers(0, 1 << 30, 128)  # new tokens: two chunks no one stored
            blocks = rng.choice(BLOCKS, 4, replace=False)
            t = time.perf_counter()
            handle = engine.start_save([(tokens, blocks)])
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
        return time.perf_counter() - begun - inside, inside

    def rounds_of(n: int) -> tuple[list[float], list[float], list[float]]:
        off, on, inside = [], [], []
        for r in range(n):
            for save in (False, True) if r % 2 == 0 else (True, False):
                times = [step(save) for _ in range(steps)]
                (on if save else off).append(statistics.median(t for t, _ in times))
                if save:
                    inside.extend(i for _, i in times)
        return off, on, inside

    try:
        rounds_of(1)  # warm-up
        off, on, inside = rounds_of(rounds)
        busy = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os\nos.sched_setaffinity(0, {{{spare}}})\nwhile True: pass",
            ]
        )
        try:
            base = [statistics.median(step(False)[0] for _ in range(steps)) for _ in range(4)]
        finally:
            busy.kill()
            busy.wait()
        alone = [statistics.median(step(False)[0] for _ in range(steps)) for _ in range(4)]
    finally:
        engine.close()
        store.close()
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    return {
        "off_ms": 1e3 * statistics.median(off),
        "on_ms": 1e3 * statistics.median(on),
        "ratio": statistics.median(on) / statistics.median(off),
        "ratios": ratios,
        "inside_ms": 1e3 * statistics.median(inside),
        "control_ratio": statistics.median(base) / statistics.median(alone),
        "rounds": rounds,
        "steps": steps,
        "cpus": {"model": model_cpu, "spare": spare},
    }


if __name__ == "__main__":
    sys.exit(main())
