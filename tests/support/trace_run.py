"""A short save and load through a SyncTransferEngine, run as ``python -m tests.support.trace_run
STORE`` (``local`` or ``shared``) by tests/test_trace.py with or without ``KVFLOW_TRACE``.
Prints one JSON line: the trace file written (or null) and whether tracing was on."""

from __future__ import annotations

import json
import sys

import numpy as np

import kvflow
from kvflow import trace
from kvflow.abc import Store
from tests.support.caches import make_caches
from tests.support.pools import ServedSharedStore, dispose

LAYERS = 4


def main(store_name: str) -> None:
    trace.set_role("engine")
    layout = kvflow.KVLayout.from_tensors(make_caches(num_layers=LAYERS), block_size=16)
    store: Store
    store = ServedSharedStore(16 << 20) if store_name == "shared" else kvflow.LocalStore("16MiB")
    tokens, blocks = list(range(64)), np.arange(4)
    try:
        with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=2)) as e:
            with e.start_save([(tokens, blocks)]) as save:
                for layer in range(LAYERS):
                    save.layer_written(layer)
                assert save.wait().count(kvflow.ChunkStatus.OK) == 2
            with e.start_load([(tokens, blocks + 8)]) as load:
                for layer in range(LAYERS):
                    load.wait_layer(layer)
                assert load.wait().count(kvflow.ChunkStatus.OK) == 2
    finally:
        dispose(store)
    enabled = trace.ENABLED
    print(json.dumps({"enabled": enabled, "file": trace.stop()}))


if __name__ == "__main__":
    main(sys.argv[1])
