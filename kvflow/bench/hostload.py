"""Client processes on the hosts of a test network: ``python -m kvflow.bench.hostload NAME JSON``.

Each runs a real ``TransferEngine`` on a ``MooncakeStore`` (``args["master"]``, reachable at
``args["address"]``, keys under ``args["prefix"]``), reports through files (``args["ready"]``
when it reaches its waiting point, ``args["result"]`` when it ends, both JSON, written
atomically) and bounds every wait. The KV of a prompt's chunk is a pure function of its tokens
(``chunk_content``), so a process on any host checks every byte another one stored.

* ``holder``: gives the pool a segment of ``args["segment"]`` and keeps it until released.
* ``saver``: saves ``args["prompts"]`` (into its own segment if it has one), then holds.
* ``loader``: loads every prompt ``args["rounds"]`` times from the pool, checks every byte, and
  reports chunks, bytes, seconds and master calls per batch.
* ``loop``: the engine of a server under steady load, until ``args["stop"]`` appears: look a
  prompt up, load what hits, check it, recompute and save what did not; one event per request
  with the time each step took and what came back. Ready once a pass over the prompts hit in
  full; ``args["progress"]`` says after each request how many there were and, per prompt, when
  the last request that hit it in full started (wall clock).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from kvflow.config import EngineConfig
from kvflow.layout import KVLayout
from kvflow.pipeline.engine import TransferEngine
from kvflow.results import ChunkStatus, TransferResult
from kvflow.stores.mooncake.store import MooncakeStore

__all__ = ["OBJECT_BYTES", "chunk_content", "prompt"]

LAYERS = 4
BLOCK_SIZE = 16
CHUNK_BLOCKS = 2
CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS
ROW_BYTES = 1024  # one token of one layer
BLOCK_BYTES = BLOCK_SIZE * ROW_BYTES
OBJECT_BYTES = LAYERS * CHUNK_BLOCKS * BLOCK_BYTES  # 128 KiB
NUM_BLOCKS = 128
WAIT_S = 300.0  # a worker's wait for the test's next step: far above a loaded machine's stall


def write_json(path: str, value: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def wait_for_file(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def prompt(i: int, chunks: int, seed: int = 0) -> np.ndarray:
    """Prompt ``i``: ``chunks`` chunks of tokens of its own."""
    rng = np.random.default_rng([seed, i])
    return rng.integers(0, 50_000, chunks * CHUNK_TOKENS).astype(np.int64)


def chunk_content(tokens: np.ndarray, chunk: int) -> np.ndarray:
    """The KV of ``chunk``: a function of the tokens up to its end, [layer, block, byte]."""
    prefix = np.ascontiguousarray(tokens[: (chunk + 1) * CHUNK_TOKENS], dtype="<i8").tobytes()
    raw = hashlib.shake_256(prefix).digest(OBJECT_BYTES)
    return np.frombuffer(raw, dtype=np.uint8).reshape(LAYERS, CHUNK_BLOCKS, BLOCK_BYTES)


def make_caches() -> list[Any]:
    import torch

    return [
        torch.zeros((NUM_BLOCKS, BLOCK_SIZE, ROW_BYTES), dtype=torch.uint8) for _ in range(LAYERS)
    ]


def _rows(cache: Any) -> np.ndarray:
    view: np.ndarray = cache.numpy().reshape(NUM_BLOCKS, BLOCK_BYTES)
    return view


def fill(caches: list[Any], tokens: np.ndarray, blocks: np.ndarray) -> None:
    """Put the prompt's KV into ``blocks``, as computing it would."""
    for c in range(len(tokens) // CHUNK_TOKENS):
        want = chunk_content(tokens, c)
        for layer in range(LAYERS):
            _rows(caches[layer])[blocks[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]] = want[layer]


def poison(caches: list[Any], blocks: np.ndarray) -> None:
    for cache in caches:
        _rows(cache)[blocks] = 0xEE


def wrong_chunks(caches: list[Any], tokens: np.ndarray, blocks: np.ndarray, ok: Any) -> int:
    """How many of the chunks reported loaded (``ok``: their indices) hold other bytes."""
    wrong = 0
    for c in ok:
        want = chunk_content(tokens, int(c))
        here = blocks[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]
        if any(not np.array_equal(_rows(caches[i])[here], want[i]) for i in range(LAYERS)):
            wrong += 1
    return wrong


def store_for(args: dict[str, Any], segment: int | str) -> MooncakeStore:
    return MooncakeStore(
        master_server_address=args["master"],
        local_hostname=args["address"],
        global_segment_size=segment,
        key_prefix=args["prefix"],
        timeout_s=float(args.get("timeout_s", 5.0)),
    )


def engine_config(args: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        chunk_blocks=CHUNK_BLOCKS,
        op_timeout_s=float(args.get("op_timeout_s", 10.0)),
        copy_timeout_s=float(args.get("copy_timeout_s", 5.0)),
    )


def _prompts(args: dict[str, Any]) -> list[np.ndarray]:
    chunks = int(args.get("chunks", 4))
    return [prompt(i, chunks, int(args.get("seed", 0))) for i in args["prompts"]]


def _blocks(tokens: np.ndarray, offset: int = 0) -> np.ndarray:
    return (np.arange(len(tokens) // BLOCK_SIZE) + offset) % NUM_BLOCKS


def holder(args: dict[str, Any]) -> dict[str, Any]:
    store = store_for(args, args["segment"])
    try:
        write_json(args["ready"], {"pid": os.getpid(), "endpoint": store.stats().local_endpoint})
        released = wait_for_file(args["release"], float(args.get("hold_s", WAIT_S)))
    finally:
        store.close()
    return {"released": released}


async def _saver(args: dict[str, Any]) -> dict[str, Any]:
    caches = make_caches()
    layout = KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    store = store_for(args, args.get("segment", 0))
    statuses: list[list[int]] = []
    try:
        async with TransferEngine(layout, store, engine_config(args)) as engine:
            for tokens in _prompts(args):
                blocks = _blocks(tokens)
                fill(caches, tokens, blocks)
                result = await engine.save(tokens, blocks)
                statuses.append(result.requests[0].chunk_status.tolist())
            write_json(args["ready"], {"status": statuses})
            if args.get("release"):
                wait_for_file(args["release"], float(args.get("hold_s", WAIT_S)))
    finally:
        store.close()
    return {"status": statuses}


async def _loader(args: dict[str, Any]) -> dict[str, Any]:
    caches = make_caches()
    layout = KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    store = store_for(args, 0)
    tally = dict.fromkeys(("chunks_ok", "wrong", "missing", "failed", "lookups_short"), 0)
    master_calls: set[int] = set()
    copy_calls: set[int] = set()
    every = _prompts(args)
    try:
        async with TransferEngine(layout, store, engine_config(args)) as engine:
            write_json(args["ready"], {"pid": os.getpid()})
            if args.get("go") and not wait_for_file(args["go"], WAIT_S):
                raise TimeoutError(f"no {args['go']} after {WAIT_S:g} s")
            seconds = 0.0  # in lookups and loads only (not in the checks)
            for _ in range(int(args.get("rounds", 1))):
                for tokens in every:
                    blocks = _blocks(tokens, 64)
                    poison(caches, blocks)
                    start = time.perf_counter()
                    found = await engine.lookup(tokens)
                    before = store.stats()
                    result = await engine.load(tokens, blocks)
                    seconds += time.perf_counter() - start
                    after = store.stats()
                    if found != len(tokens):
                        tally["lookups_short"] += 1
                    master_calls.add(after.master_calls - before.master_calls)
                    copy_calls.add(after.copy_calls - before.copy_calls)
                    status = result.requests[0].chunk_status
                    ok = np.flatnonzero(status == ChunkStatus.OK)
                    tally["chunks_ok"] += len(ok)
                    tally["missing"] += int(np.count_nonzero(status == ChunkStatus.MISSING))
                    tally["failed"] += int(np.count_nonzero(status == ChunkStatus.FAILED))
                    tally["wrong"] += wrong_chunks(caches, tokens, blocks, ok)
    finally:
        store.close()
    return {
        **tally,
        "bytes": tally["chunks_ok"] * OBJECT_BYTES,
        "seconds": seconds,
        "master_calls_per_batch": sorted(master_calls),
        "copy_calls_per_batch": sorted(copy_calls),
    }


async def _bounded(step: Any, bound: float, event: dict[str, Any]) -> tuple[Any, float, bool]:
    """Run ``step`` (an awaitable); (its value or None, seconds, whether it ran past ``bound``,
    which is a hang). An error it raises (the engine's own timeout) is named in ``event``."""
    start = time.perf_counter()
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait((task,), timeout=bound)
    seconds = time.perf_counter() - start
    if not done:
        task.cancel()
        return None, seconds, True
    if task.exception() is not None:
        event.setdefault("errors", []).append(type(task.exception()).__name__)
        return None, seconds, False
    return task.result(), seconds, False


async def _load(
    engine: TransferEngine, tokens: np.ndarray, blocks: np.ndarray, event: dict[str, Any]
) -> TransferResult:
    """Load, and before the blocks are used again make sure no copy can still write them: a
    copy past its timeout is waited for (at most the engine's grace), as the vLLM connector
    does; ``event["stopped"]`` if one outlived that."""
    handle = await engine.start_load([(tokens, blocks)])
    try:
        return await handle.wait()
    finally:
        start = time.perf_counter()
        if not await handle.aclose(wait=True):
            event["stopped"] = True
        if time.perf_counter() - start > 0.001:
            event["settle_s"] = time.perf_counter() - start


async def _loop(args: dict[str, Any]) -> dict[str, Any]:
    caches = make_caches()
    layout = KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    config = engine_config(args)
    store = store_for(args, 0)
    every = _prompts(args)
    hard = float(args.get("hard_bound_s", 120.0))  # a hang, not a slow step: recorded as such
    events: list[dict[str, Any]] = []
    warm = False
    full: dict[int, float] = {}  # prompt -> when its last request that hit in full started
    deadline = time.monotonic() + float(args.get("max_s", WAIT_S))
    try:
        async with TransferEngine(layout, store, config) as engine:
            k = 0
            stop = args["stop"]
            while time.monotonic() < deadline and not await asyncio.to_thread(os.path.exists, stop):
                tokens = every[k % len(every)]
                blocks = _blocks(tokens, 64)
                event: dict[str, Any] = {"t": time.time(), "prompt": k % len(every)}
                hit, event["lookup_s"], hung_lookup = await _bounded(
                    engine.lookup(tokens), hard, event
                )
                hit = hit or 0
                event["hit_chunks"] = hit // CHUNK_TOKENS
                ok = np.zeros(0, dtype=np.int64)
                status = np.zeros(0)
                hung_load = False
                if hit:
                    poison(caches, blocks)
                    result, event["load_s"], hung_load = await _bounded(
                        _load(engine, tokens[:hit], blocks[: hit // BLOCK_SIZE], event), hard, event
                    )
                    if event.get("stopped"):  # a copy outlived the grace: as the connector does
                        events.append(event)
                        break
                    if result is not None:
                        status = result.requests[0].chunk_status
                        ok = np.flatnonzero(status == ChunkStatus.OK)
                event["ok"] = len(ok)
                event["failed"] = int(np.count_nonzero(status == ChunkStatus.FAILED))
                event["missing"] = int(np.count_nonzero(status == ChunkStatus.MISSING))
                event["wrong"] = wrong_chunks(caches, tokens, blocks, ok)
                hung_save = False
                if len(ok) < len(tokens) // CHUNK_TOKENS:  # recompute, and save it for next time
                    fill(caches, tokens, blocks)
                    saved, event["save_s"], hung_save = await _bounded(
                        engine.save(tokens, blocks), hard, event
                    )
                    if saved is not None:
                        event["saved"] = saved.count(ChunkStatus.OK)
                event["hung"] = hung_lookup or hung_load or hung_save
                events.append(event)
                k += 1
                if len(ok) == len(tokens) // CHUNK_TOKENS:
                    full[event["prompt"]] = event["t"]
                progress = {"requests": k, "full_hit": full}
                await asyncio.to_thread(write_json, args["progress"], progress)
                if (
                    not warm
                    and k >= len(every)
                    and all(e["ok"] == len(tokens) // CHUNK_TOKENS for e in events[-len(every) :])
                ):
                    warm = True
                    ready = {"pid": os.getpid(), "requests": k}
                    await asyncio.to_thread(write_json, args["ready"], ready)
                await asyncio.sleep(float(args.get("pause_s", 0.01)))
            stats = store.stats()
    finally:
        store.close()
    return {
        "events": events,
        "warm": warm,
        "open_sessions": stats.open_sessions,
        "late_sessions": stats.late_sessions,  # started by answers after their timeout, ended
    }


def saver(args: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_saver(args))


def loader(args: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_loader(args))


def loop(args: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_loop(args))


COMMANDS = {"holder": holder, "saver": saver, "loader": loader, "loop": loop}


def main(argv: list[str]) -> int:
    name, args = argv[1], json.loads(argv[2])
    write_json(args["result"], COMMANDS[name](args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
