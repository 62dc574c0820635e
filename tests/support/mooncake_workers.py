"""Processes for the Mooncake tests: ``python -m tests.support.mooncake_workers NAME JSON_ARGS``.

They keep the conventions of ``tests.support.pool_workers`` (ready and result files, bounded
waits) and its prompts and chunk contents, so a test process can check every byte another one
stored.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import numpy as np

import kvflow
from tests.support.pool_workers import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    NUM_BLOCKS,
    fill,
    make_caches,
    prompts,
    wait_for_file,
    write_json,
)


def engine_config() -> kvflow.EngineConfig:
    """What every process of these tests runs with (the keys depend on it)."""
    return kvflow.EngineConfig(chunk_blocks=CHUNK_BLOCKS, op_timeout_s=10, copy_timeout_s=5)


def store_for(args: dict[str, Any], segment: int | str) -> kvflow.MooncakeStore:
    return kvflow.MooncakeStore(
        master_server_address=args["master"],
        local_hostname="127.0.0.1",
        global_segment_size=segment,
        key_prefix=args["prefix"],
        timeout_s=5.0,
    )


def blocks_of(i: int, tokens: np.ndarray) -> np.ndarray:
    """Where prompt ``i`` sits in the caches of the saving process: disjoint per prompt."""
    n = len(tokens) // BLOCK_SIZE
    return (np.arange(n) + 8 * i) % NUM_BLOCKS


async def _save_and_hold(args: dict[str, Any]) -> dict[str, Any]:
    every = prompts()
    caches = make_caches()
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK_SIZE)
    store = store_for(args, "64MiB")
    statuses = []
    try:
        async with kvflow.TransferEngine(layout, store, engine_config()) as engine:
            for i in args["prompts"]:
                tokens = every[i]
                blocks = blocks_of(i, tokens)
                fill(caches, tokens, blocks)
                result = await engine.save(tokens, blocks)
                statuses.append(result.requests[0].chunk_status.tolist())
            write_json(args["ready"], {"status": statuses, "pid": os.getpid()})
            wait_for_file(args["release"], args.get("hold_s", 120))
    finally:
        store.close()
    return {"status": statuses}


def save_and_hold(args: dict[str, Any]) -> dict[str, Any]:
    """Save ``prompts`` into this process's own Mooncake segment, report, and keep the segment
    alive until the release file appears (the bytes live in this process's memory)."""
    return asyncio.run(_save_and_hold(args))


COMMANDS = {"save_and_hold": save_and_hold}


def main(argv: list[str]) -> int:
    import json

    name, args = argv[1], json.loads(argv[2])
    write_json(args["result"], COMMANDS[name](args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
