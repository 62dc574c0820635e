"""SyncTransferEngine: the blocking interface for callers without an event loop."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import kvflow
from tests.conftest import make_caches
from tests.pipeline.wrappers import WrappedStore
from tests.pools import dispose, make_store

BS = 16


def test_layerwise_round_trip_from_plain_threads(store_name: str) -> None:
    caches = make_caches(8)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = make_store(store_name, "16MiB")
    cfg = kvflow.EngineConfig(chunk_blocks=2, prefetch_layers=2)
    with kvflow.SyncTransferEngine(layout, store, cfg) as engine:
        tokens = np.arange(128)
        save = engine.start_save([(tokens, np.arange(8))])
        for layer in range(8):
            save.layer_written(layer, timeout=5)
        assert save.wait(timeout=5).ok
        assert engine.lookup(tokens) == 128

        seen: list[int] = []

        def worker() -> None:  # another thread, as an inference worker's forward would be
            load = engine.start_load([(tokens, np.arange(30, 38))])
            for layer in range(8):
                load.wait_layer(layer, timeout=5)
                seen.append(layer)
            assert load.wait(timeout=5).ok

        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        assert seen == list(range(8))
        for c in caches:
            assert torch.equal(c[30:38].view(torch.uint8), c[0:8].view(torch.uint8))
        stats = engine.stats()
        assert stats.layer_waits == [1] * 8 and stats.blocks_loaded == 8
    dispose(store)


def test_sync_wait_layer_times_out_and_close_stops_the_thread(store_name: str) -> None:
    layout = kvflow.KVLayout.from_tensors(make_caches(3), block_size=BS)
    store = WrappedStore(make_store(store_name, "8MiB"))
    gate = threading.Event()
    engine = kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1))
    engine.save(np.arange(16), [0])
    store.before_copy = lambda *a: gate.wait(5) and None
    handle = engine.start_load([(np.arange(16), [5])])
    start = time.monotonic()
    with pytest.raises(kvflow.TransferTimeoutError):
        handle.wait_layer(0, timeout=0.05)
    assert time.monotonic() - start < 1.0
    gate.set()
    assert handle.wait(timeout=5).ok
    engine.close()
    assert not engine._thread.is_alive()
    with pytest.raises(kvflow.ClosedError):
        engine.lookup(np.arange(16))
    dispose(store)


def test_sync_layer_written_returns_at_once_and_blocks_only_at_a_full_backlog(
    store_name: str,
) -> None:
    caches = make_caches(4)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = WrappedStore(make_store(store_name, "8MiB"))
    gate = threading.Event()
    store.before_copy = lambda *a: gate.wait(5) and None
    cfg = kvflow.EngineConfig(chunk_blocks=1, save_backlog=1)
    with kvflow.SyncTransferEngine(layout, store, cfg) as engine:
        tokens = np.arange(32)
        save = engine.start_save([(tokens, [0, 1])])
        save.layer_written(0, timeout=1)  # a free slot: handed over without waiting
        with pytest.raises(kvflow.TransferTimeoutError):
            save.layer_written(1, timeout=0.05)  # the backlog is full: the producer waits
        errors: list[BaseException] = []

        def again() -> None:
            try:
                save.layer_written(1, timeout=5)
            except kvflow.KVFlowError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=again) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        gate.set()
        for t in threads:
            t.join(5)
        assert len(errors) == 1 and isinstance(errors[0], kvflow.InvalidArgumentError)
        for layer in (2, 3):
            save.layer_written(layer, timeout=5)
        assert save.wait(timeout=5).ok
        store.before_copy = lambda *a: None
        assert engine.load(tokens, [5, 6]).ok
        for c in caches:
            assert torch.equal(c[5:7].view(torch.uint8), c[0:2].view(torch.uint8))
    dispose(store)
