"""Client processes for the pool tests: ``python -m tests.support.pool_workers NAME JSON_ARGS``.

Every worker gets its arguments as one JSON object, signals that it reached its waiting point
by writing ``args["ready"]`` (JSON, written atomically), and writes its result to
``args["result"]`` when it finishes. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np

import kvflow
from kvflow.abc import Direction, WriteStatus

# -- shared by the tests and the workers ------------------------------------------------------

BLOCK_SIZE = 16
CHUNK_BLOCKS = 2
CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS
LAYERS = 3
NUM_BLOCKS = 64
BLOCK_BYTES = 256  # of one layer: uint8 [BLOCK_SIZE, 16]
OBJECT_BYTES = LAYERS * CHUNK_BLOCKS * BLOCK_BYTES
NUM_PROMPTS = 24
# how long a worker waits for the test's go (or release) file: the test's own steps before it
# (other workers starting on a loaded machine) take that long at most
GO_WAIT_S = 180.0


def write_json(path: str, value: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def wait_for_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout:g} s")
        time.sleep(0.01)


def key_bytes(key: str, size: int) -> np.ndarray:
    """The bytes stored under ``key`` by the store-level workers: a function of the key."""
    return np.frombuffer(hashlib.shake_256(key.encode()).digest(size), dtype=np.uint8)


def prompts() -> list[np.ndarray]:
    """The prompts every engine worker knows: a tree of shared prefixes. Prompt i is
    ROOT[i % 2] + MID[i % 6] + its own 0..2 chunks, so chunks are shared by 2..12 prompts."""
    rng = np.random.default_rng(1234)
    roots = [rng.integers(0, 50_000, CHUNK_TOKENS) for _ in range(2)]
    mids = [rng.integers(0, 50_000, CHUNK_TOKENS) for _ in range(6)]
    out = []
    for i in range(NUM_PROMPTS):
        own = rng.integers(0, 50_000, CHUNK_TOKENS * (i % 3))
        out.append(np.concatenate([roots[i % 2], mids[i % 6], own]).astype(np.int64))
    return out


def chunk_content(tokens: np.ndarray, chunk: int) -> np.ndarray:
    """The KV of ``chunk`` of a prompt: a pure function of the tokens up to its end (which is
    what its key hashes), shaped [layer, block in chunk, byte]."""
    prefix = np.ascontiguousarray(tokens[: (chunk + 1) * CHUNK_TOKENS], dtype="<i8").tobytes()
    raw = hashlib.shake_256(prefix).digest(OBJECT_BYTES)
    return np.frombuffer(raw, dtype=np.uint8).reshape(LAYERS, CHUNK_BLOCKS, BLOCK_BYTES)


def make_caches() -> list[Any]:
    import torch

    return [torch.zeros((NUM_BLOCKS, BLOCK_SIZE, 16), dtype=torch.uint8) for _ in range(LAYERS)]


def fill(caches: list[Any], tokens: np.ndarray, block_ids: np.ndarray) -> None:
    for c in range(len(tokens) // CHUNK_TOKENS):
        want = chunk_content(tokens, c)
        for layer in range(LAYERS):
            view = caches[layer].numpy().reshape(NUM_BLOCKS, BLOCK_BYTES)
            view[block_ids[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]] = want[layer]


def check(caches: list[Any], tokens: np.ndarray, block_ids: np.ndarray, chunk: int) -> bool:
    want = chunk_content(tokens, chunk)
    blocks = block_ids[chunk * CHUNK_BLOCKS : (chunk + 1) * CHUNK_BLOCKS]
    for layer in range(LAYERS):
        view = caches[layer].numpy().reshape(NUM_BLOCKS, BLOCK_BYTES)
        if not np.array_equal(view[blocks], want[layer]):
            return False
    return True


# -- workers ----------------------------------------------------------------------------------


async def _engine(args: dict[str, Any]) -> dict[str, Any]:
    index, processes = args["index"], args["processes"]
    rng = random.Random(1000 + index)
    every = prompts()
    mine = [i for i in range(NUM_PROMPTS) if i % processes == index]
    caches = make_caches()
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    store = kvflow.SharedStore(socket=args["socket"], timeout_s=60)
    # far above a stall of the machine the processes share: the test counts any failed chunk
    config = kvflow.EngineConfig(chunk_blocks=CHUNK_BLOCKS, op_timeout_s=60, copy_timeout_s=60)
    tally = dict.fromkeys(
        ("saves", "saved_chunks", "exists", "no_space", "loads", "loaded_ok", "missing",
         "failed", "mismatches", "loaded_foreign"),
        0,
    )  # fmt: skip
    errors: list[str] = []
    saved: set[tuple[int, int]] = set()  # (prompt, chunk) this process stored itself

    async def save(i: int) -> None:
        tokens = every[i]
        blocks = np.array(rng.sample(range(NUM_BLOCKS), len(tokens) // BLOCK_SIZE))
        fill(caches, tokens, blocks)
        result = await eng.save(tokens, blocks)
        status = result.requests[0].chunk_status
        tally["saves"] += 1
        tally["saved_chunks"] += int((status == kvflow.ChunkStatus.OK).sum())
        tally["exists"] += int((status == kvflow.ChunkStatus.EXISTS).sum())
        tally["no_space"] += int((status == kvflow.ChunkStatus.NO_SPACE).sum())
        tally["failed"] += int((status == kvflow.ChunkStatus.FAILED).sum())
        for c in np.flatnonzero(status == kvflow.ChunkStatus.OK):
            saved.add((i, int(c)))

    async def load(i: int) -> None:
        tokens = every[i]
        blocks = np.array(rng.sample(range(NUM_BLOCKS), len(tokens) // BLOCK_SIZE))
        for layer in range(LAYERS):  # garbage where the load goes: an unloaded block shows
            caches[layer].numpy().reshape(NUM_BLOCKS, BLOCK_BYTES)[blocks] = 0xEE
        async with await eng.start_load([(tokens, blocks)]) as handle:
            for layer in range(LAYERS):
                await handle.wait_layer(layer)
            result = await handle.wait()
        status = result.requests[0].chunk_status
        tally["loads"] += 1
        tally["missing"] += int((status == kvflow.ChunkStatus.MISSING).sum())
        tally["failed"] += int((status == kvflow.ChunkStatus.FAILED).sum())
        for c in np.flatnonzero(status == kvflow.ChunkStatus.OK):
            tally["loaded_ok"] += 1
            if (i, int(c)) not in saved:
                tally["loaded_foreign"] += 1
            if not check(caches, tokens, blocks, int(c)):
                tally["mismatches"] += 1
                if len(errors) < 5:
                    errors.append(f"prompt {i} chunk {c}: loaded bytes differ")

    try:
        async with kvflow.TransferEngine(layout, store, config) as eng:
            write_json(args["ready"], {"pid": os.getpid()})
            wait_for_file(args["go"], GO_WAIT_S)
            deadline = time.monotonic() + args["seconds"]
            while time.monotonic() < deadline:
                await save(rng.choice(mine))
                await load(rng.randrange(NUM_PROMPTS))
            for i in range(NUM_PROMPTS):  # every prompt any process saved, once more
                await load(i)
            tally["engine_failed_chunks"] = eng.stats().failed_chunks
    finally:
        store.close()
    return {**tally, "errors": errors}


def engine(args: dict[str, Any]) -> dict[str, Any]:
    """Save this process's prompts and load everyone's through a TransferEngine on a
    SharedStore for ``seconds``, checking every loaded chunk byte for byte."""
    return asyncio.run(_engine(args))


def _registered(store: kvflow.SharedStore, nbytes: int) -> np.ndarray:
    buf = np.zeros(nbytes, dtype=np.uint8)
    store.register([(int(buf.ctypes.data), nbytes)])
    return buf


def hold_writes(args: dict[str, Any]) -> dict[str, Any]:
    """Open writes for ``keys``, copy some of their bytes, report, then wait to be killed."""
    keys, nbytes = args["keys"], args["nbytes"]
    store = kvflow.SharedStore(socket=args["socket"], timeout_s=60)
    buf = _registered(store, nbytes * len(keys))
    session = store.open_write(keys, nbytes)
    granted = np.flatnonzero(session.status == WriteStatus.GRANTED)
    for j, i in enumerate(granted):
        buf[j * nbytes : (j + 1) * nbytes] = key_bytes(keys[i], nbytes)
    half = granted[: max(1, len(granted) // 2)] if granted.size else granted
    failed = store.batch_copy(
        session.addrs[half].astype(np.int64),
        np.array([int(buf.ctypes.data) + j * nbytes for j in range(len(half))], np.int64),
        np.full(len(half), nbytes // 2, np.int64),  # half of each object: mid-write
        Direction.TO_POOL,
    )
    write_json(args["ready"], {"status": session.status.tolist(), "failed": failed.tolist()})
    time.sleep(args.get("hold_s", 120))  # the test kills us long before
    return {"killed": False}


def hold_leases(args: dict[str, Any]) -> dict[str, Any]:
    """Lease ``keys``, report, then wait to be killed."""
    store = kvflow.SharedStore(socket=args["socket"], timeout_s=60)
    session = store.open_read(args["keys"])
    write_json(args["ready"], {"found": session.found.tolist()})
    time.sleep(args.get("hold_s", 120))
    return {"killed": False}


def autostart(args: dict[str, Any]) -> dict[str, Any]:
    """Wait for the go file, then start-or-join a pool with ``auto_start=True``, save and look
    up; report, and hold the connection until the release file appears."""
    from kvflow.pool.launch import read_pid

    wait_for_file(args["go"], GO_WAIT_S)
    started = time.monotonic()
    store = kvflow.SharedStore(
        socket=args["socket"], auto_start=True, capacity="64MiB", timeout_s=60, start_timeout_s=60
    )
    try:
        own, common = f"auto/{args['tag']}", "auto/common"
        size = 4096
        buf = _registered(store, 2 * size)
        session = store.open_write([own, common], size)
        granted = np.flatnonzero(session.status == WriteStatus.GRANTED)
        for j, i in enumerate(granted):
            buf[j * size : (j + 1) * size] = key_bytes(session.keys[i], size)
        failed = store.batch_copy(
            session.addrs[granted].astype(np.int64),
            np.array([int(buf.ctypes.data) + j * size for j in range(len(granted))], np.int64),
            np.full(len(granted), size, np.int64),
            Direction.TO_POOL,
        )
        store.finish_write(session, np.ones(2, dtype=bool))
        found_own = bool(store.lookup([own])[0])
        deadline = time.monotonic() + 60  # another worker may still be writing `common`
        while not store.lookup([common])[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        found = store.lookup([own, common]).tolist()
        connected_s = time.monotonic() - started
        report = {
            "status": session.status.tolist(),
            "failed": failed.tolist(),
            "found_own": found_own,
            "found": found,
            "server_pid": read_pid(store.socket_path),
            "instance": store._conn.hello.instance if store._conn else None,
            "seconds": connected_s,
        }
        write_json(args["ready"], report)
        wait_for_file(args["release"], GO_WAIT_S)
    finally:
        store.close()
    return report


COMMANDS = {
    "engine": engine,
    "hold_writes": hold_writes,
    "hold_leases": hold_leases,
    "autostart": autostart,
}


def main(argv: list[str]) -> int:
    name, args = argv[1], json.loads(argv[2])
    result = COMMANDS[name](args)
    write_json(args["result"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
