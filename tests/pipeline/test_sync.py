"""SyncTransferEngine: the blocking interface for callers without an event loop."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import kvflow
from kvflow.abc import Store
from tests.support.caches import make_caches
from tests.support.gates import Gate
from tests.support.pools import dispose, make_store
from tests.support.waits import wait_until
from tests.support.wrappers import WrappedStore

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
            save.layer_written(layer, timeout=60)
        assert save.wait(timeout=60).ok
        assert engine.lookup(tokens) == 128

        seen: list[int] = []

        def worker() -> None:  # another thread, as an inference worker's forward would be
            load = engine.start_load([(tokens, np.arange(30, 38))])
            for layer in range(8):
                load.wait_layer(layer, timeout=60)
                seen.append(layer)
            assert load.wait(timeout=60).ok

        t = threading.Thread(target=worker)
        t.start()
        t.join(120)
        assert not t.is_alive()
        assert seen == list(range(8))
        for c in caches:
            assert torch.equal(c[30:38].view(torch.uint8), c[0:8].view(torch.uint8))
        stats = engine.stats()
        assert stats.layer_waits == [1] * 8 and stats.blocks_loaded == 8
    dispose(store)


def test_sync_wait_layer_times_out_and_close_stops_the_thread(store_name: str) -> None:
    layout = kvflow.KVLayout.from_tensors(make_caches(3), block_size=BS)
    store = WrappedStore(make_store(store_name, "8MiB"))
    gate = Gate()
    engine = kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1))
    engine.save(np.arange(16), [0])
    store.before_copy = gate
    handle = engine.start_load([(np.arange(16), [5])])
    with pytest.raises(kvflow.TransferTimeoutError):
        handle.wait_layer(0, timeout=0.05)
    assert gate.passed == 0  # no copy got through: the wait did not wait for layer 0's
    gate.set()
    assert handle.wait(timeout=60).ok
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
    gate = Gate()
    store.before_copy = gate
    cfg = kvflow.EngineConfig(chunk_blocks=1, save_backlog=1, deferred_saves=False)
    with kvflow.SyncTransferEngine(layout, store, cfg) as engine:
        tokens = np.arange(32)
        save = engine.start_save([(tokens, [0, 1])])
        save.layer_written(0, timeout=60)  # (this first call also waits for the session)
        assert gate.passed == 0  # a free slot: handed over without waiting for its copy
        with pytest.raises(kvflow.TransferTimeoutError):
            save.layer_written(1, timeout=0.05)  # the backlog is full: the producer waits
        errors: list[BaseException] = []

        def again() -> None:
            try:
                save.layer_written(1, timeout=60)
            except kvflow.KVFlowError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=again) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.05)  # lets both wait at once; in either order one call is refused
        gate.set()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], kvflow.InvalidArgumentError)
        for layer in (2, 3):
            save.layer_written(layer, timeout=60)
        assert save.wait(timeout=60).ok
        store.before_copy = lambda *a: None
        assert engine.load(tokens, [5, 6]).ok
        for c in caches:
            assert torch.equal(c[5:7].view(torch.uint8), c[0:2].view(torch.uint8))
    dispose(store)


class SlowOpen(WrappedStore):
    """A real LocalStore whose ``open_read`` waits for ``gate``, and ``open_write`` for
    ``write_gate`` (open at first): a slow pool round trip."""

    def __init__(self) -> None:
        super().__init__(kvflow.LocalStore("8MiB"))
        self.gate = threading.Event()
        self.opened = threading.Event()
        self.write_gate = threading.Event()
        self.write_gate.set()
        self.write_opened = threading.Event()

    def open_read(self, keys):  # type: ignore[no-untyped-def]
        self.gate.wait(60)
        try:
            return super().open_read(keys)
        finally:
            self.opened.set()

    def open_write(self, keys, nbytes):  # type: ignore[no-untyped-def]
        self.write_gate.wait(60)
        try:
            return super().open_write(keys, nbytes)
        finally:
            self.write_opened.set()


def saved_engine(store: Store, caches: list[torch.Tensor]) -> kvflow.SyncTransferEngine:
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    engine = kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1))
    assert engine.save(np.arange(32), [0, 1]).ok
    return engine


def test_start_load_returns_before_the_store_session_opens() -> None:
    caches = make_caches(3)
    store = SlowOpen()
    engine = saved_engine(store, caches)
    handle = engine.start_load([(np.arange(32), [6, 7])])
    assert not store.opened.is_set()  # returned while the open is held at the gate
    assert not handle.done()
    threading.Timer(0.1, store.gate.set).start()
    for layer in range(3):
        handle.wait_layer(layer, timeout=60)  # the first waits for the open, then the copy
    assert handle.wait(timeout=60).ok and handle.done()
    for c in caches:
        assert torch.equal(c[6:8].view(torch.uint8), c[0:2].view(torch.uint8))
    engine.close()
    assert store.usage().leases == 0
    store.close()


def test_start_load_refuses_bad_requests_at_once() -> None:
    store = SlowOpen()
    engine = saved_engine(store, make_caches(3))
    with pytest.raises(kvflow.InvalidArgumentError, match="block_ids"):
        engine.start_load([(np.arange(32), [6, 10_000])])
    assert not store.opened.is_set()  # the store was not asked
    engine.close()
    store.close()


def test_a_load_closed_while_its_session_opens_releases_it_when_it_opens() -> None:
    store = SlowOpen()
    engine = saved_engine(store, make_caches(3))
    handle = engine.start_load([(np.arange(32), [6, 7])])
    with pytest.raises(kvflow.TransferTimeoutError, match="store session"):
        handle.wait_layer(0, timeout=0.05)
    handle.close()  # returns: the session is not open yet
    store.gate.set()
    wait_until(
        lambda: handle.done() and store.usage().leases == 0, 60, "the late session's release"
    )
    assert handle.done() and store.usage().leases == 0 and store.usage().open_sessions == 0
    engine.close()
    store.close()


def test_start_save_returns_before_the_store_session_opens() -> None:
    caches = make_caches(3)
    store = SlowOpen()
    engine = saved_engine(store, caches)
    store.write_gate.clear()
    store.write_opened.clear()
    save = engine.start_save([(np.arange(100, 132), [2, 3])])
    assert not store.write_opened.is_set()  # returned while the open is held at the gate
    assert not save.done()
    threading.Timer(0.1, store.write_gate.set).start()
    for layer in range(3):
        save.layer_written(layer, timeout=60)  # the first waits for the open
    assert save.wait(timeout=60).ok and save.done()
    store.gate.set()
    assert engine.load(np.arange(100, 132), [6, 7]).ok
    for c in caches:
        assert torch.equal(c[6:8].view(torch.uint8), c[2:4].view(torch.uint8))
    engine.close()
    store.close()


def test_start_save_refuses_bad_requests_at_once() -> None:
    store = SlowOpen()
    engine = saved_engine(store, make_caches(3))
    store.write_opened.clear()
    with pytest.raises(kvflow.InvalidArgumentError, match="block_ids"):
        engine.start_save([(np.arange(32), [6, 10_000])])
    assert not store.write_opened.is_set()  # the store was not asked
    engine.close()
    store.close()


def test_a_save_closed_while_its_session_opens_aborts_it_when_it_opens() -> None:
    store = SlowOpen()
    engine = saved_engine(store, make_caches(3))
    objects = store.usage().objects
    store.write_gate.clear()
    save = engine.start_save([(np.arange(100, 132), [2, 3])])
    with pytest.raises(kvflow.TransferTimeoutError, match="store session"):
        save.layer_written(0, timeout=0.05)
    save.close()  # returns: the session is not open yet
    store.write_gate.set()
    wait_until(
        lambda: save.done() and store.usage().open_sessions == 0, 60, "the late session's abort"
    )
    usage = store.usage()
    assert save.done() and usage.open_sessions == 0 and usage.pending_writes == 0
    assert usage.objects == objects  # nothing of the closed save was committed
    engine.close()
    store.close()


class _HeldRelease(WrappedStore):
    """The real store, with the end of a read session held while ``gate`` is not set."""

    gate: threading.Event | None = None

    def close_read(self, session: object) -> None:
        if self.gate is not None:
            self.gate.wait(60)
        super().close_read(session)  # type: ignore[arg-type]


def test_wait_reads_a_published_result_without_the_loop(store_name: str) -> None:
    """The result comes out only once the read lease is released; from then on ``wait`` reads
    it on the caller's thread, even while the loop thread is busy: the end of a forward that
    overlapped the whole load waits for no thread to be scheduled."""
    layout = kvflow.KVLayout.from_tensors(make_caches(4), block_size=BS)
    store = _HeldRelease(make_store(store_name, "8MiB"))
    engine = kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1))
    engine.save(np.arange(32), [0, 1])
    store.gate = threading.Event()
    load = engine.start_load([(np.arange(32), [5, 6])])
    for layer in range(4):
        load.wait_layer(layer, timeout=60)
    time.sleep(0.1)
    assert load.handle.result_now() is None  # every layer is in, the lease is still held
    store.gate.set()
    wait_until(load.done, 60, "the load to end")
    busy, blocked, unblocked = threading.Event(), threading.Event(), threading.Event()

    def block_the_loop() -> None:
        blocked.set()
        busy.wait(60)
        unblocked.set()

    engine._loop.call_soon_threadsafe(block_the_loop)
    assert blocked.wait(60), "the loop did not run the blocking call"
    result = load.wait(timeout=1)  # through the loop, this would time out
    assert not unblocked.is_set()  # the loop was still blocked: the wait did not need it
    assert result.ok and result.requests[0].ok_tokens == 32
    busy.set()
    engine.close()
    dispose(store)


@pytest.mark.parametrize("opened", [False, True], ids=["while-opening", "after-open"])
def test_load_all_lets_every_layer_load_without_a_wait(opened: bool) -> None:
    """A load nobody waits on layer by layer (prefetch window of one layer) ends on its own
    after ``load_all``, whether its session was still opening or open: ``done()`` turns true
    and ``wait`` returns the result at once."""
    caches = make_caches(6)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = make_store("local", "8MiB")
    cfg = kvflow.EngineConfig(chunk_blocks=2, prefetch_layers=1)
    with kvflow.SyncTransferEngine(layout, store, cfg) as engine:
        tokens = np.arange(64)
        assert engine.save(tokens, [0, 1, 2, 3]).ok
        load = engine.start_load([(tokens, np.arange(10, 14))])
        if opened:
            load.wait_layer(0, timeout=60)
        load.load_all()
        wait_until(load.done, 60, "the load to end on its own")
        assert load.wait(timeout=0.5).ok
        for c in caches:
            assert torch.equal(c[10:14].view(torch.uint8), c[0:4].view(torch.uint8))
    dispose(store)
