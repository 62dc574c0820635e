"""The CUDA copy path, run on CPU: kvflow's own code around the CUDA runtime, with a stand-in.

No GPU runs here, so the CUDA runtime is stood in for: ``HostRuntime`` hands the native loop
``HOST_MEMCPY_ASYNC`` (a C function with ``cudaMemcpyAsync``'s signature that memcpys host
memory) or a ctypes function that fails where a test says, and ``CudaDevice`` runs on
``torch.cpu``'s streams and events. Everything else is the code a GPU runs: the native issue
loop, the thread's mover inside the host pools' copies, the per-direction streams, the early
signal of a load, the copy thread's wait before a store commits or releases, and the pinning
calls of both host pools (with ``kvflow.copying.cuda``'s runtime replaced by a recorder). The same
paths on a real GPU: tests/cuda/.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from typing import Any

import numpy as np
import pytest
import torch

import kvflow
import kvflow.copying.cuda
from kvflow.abc import Direction, Store
from kvflow.copying.host import HOST_MEMCPY_ASYNC, NATIVE, MemcpyAsyncFn, issue_ranges
from kvflow.devices import CudaDevice, device_ops
from kvflow.results import ChunkStatus
from tests.support.caches import make_caches
from tests.support.gates import Gate
from tests.support.pools import ServedSharedStore

BS = 16


class HostRuntime:
    """Stands in for ``kvflow.copying.cuda.CudaRuntime``: copies host memory, fails when told to."""

    def __init__(self, fail_at: int | None = None, error: int = 700) -> None:
        self.calls = 0
        self.kinds: set[int] = set()
        self.streams: set[int] = set()

        def memcpy_async(dst: int, src: int, n: int, kind: int, stream: int | None) -> int:
            if fail_at is not None and self.calls == fail_at:
                return error
            self.calls += 1
            self.kinds.add(kind)
            self.streams.add(stream or 0)
            ctypes.memmove(dst, src, n)
            return 0

        self._fn = MemcpyAsyncFn(memcpy_async)  # kept alive as long as the runtime
        self.fn_addr = int(ctypes.cast(self._fn, ctypes.c_void_p).value or 0)
        # the C stand-in where nothing is to fail or be counted: the loop at full speed
        self.memcpy_async_addr = HOST_MEMCPY_ASYNC if fail_at is None and NATIVE else self.fn_addr

    def error_string(self, code: int) -> str:
        return f"stand-in error (cudaError {code})"


class Gated(CudaDevice):
    """A CudaDevice whose copy threads wait at a gate after issuing (as for a slow DMA)."""

    def __init__(self) -> None:
        super().__init__("cpu", runtime=HostRuntime())
        self.gate = Gate()
        self.waiting = threading.Event()

    def _copy_event(self) -> Any:
        device = self

        class Event(torch.cpu.Event):  # type: ignore[misc]
            def synchronize(self) -> None:
                device.waiting.set()
                assert device.gate.wait()

        return Event()


def _buffers(n: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.arange(n, dtype=np.int64) * size
    sizes = np.full(n, size, dtype=np.int64)
    return src, dst, offsets, sizes


@pytest.mark.parametrize("fail_at", [None, 0, 3])
def test_issue_ranges_calls_the_function_per_range_and_stops_at_an_error(
    fail_at: int | None,
) -> None:
    src, dst, offsets, sizes = _buffers(6, 4096)
    rt = HostRuntime(fail_at=fail_at, error=11)
    failed, error = issue_ranges(
        rt.fn_addr, offsets + dst.ctypes.data, offsets + src.ctypes.data, sizes, 0x1234, 4
    )
    done = 6 if fail_at is None else fail_at
    assert (failed, error) == ((-1, 0) if fail_at is None else (fail_at, 11))
    assert rt.calls == done and rt.kinds == ({4} if done else set())
    assert rt.streams == ({0x1234} if done else set())
    assert np.array_equal(dst[: done * 4096], src[: done * 4096])
    assert not dst[done * 4096 :].any()  # nothing after the failed range was issued


@pytest.mark.skipif(not NATIVE, reason="the native copy loop is not built")
def test_the_native_loop_with_the_host_stand_in_is_bit_exact() -> None:
    src, dst, offsets, sizes = _buffers(64, 64 << 10)
    order = np.random.default_rng(1).permutation(64)  # scattered, as blocks are
    got = issue_ranges(
        HOST_MEMCPY_ASYNC,
        offsets[order] + dst.ctypes.data,
        offsets + src.ctypes.data,
        sizes,
        0,
        4,
    )
    assert got == (-1, 0)
    assert np.array_equal(dst.reshape(64, -1)[order], src.reshape(64, -1))


def test_device_ops_gives_cuda_its_own_device() -> None:
    cuda = device_ops("cuda:1")
    assert isinstance(cuda, CudaDevice) and cuda.device == torch.device("cuda:1")
    assert not isinstance(device_ops("cpu"), CudaDevice)
    assert "cuda" in kvflow.LocalStore.device_memory
    assert "cuda" in kvflow.SharedStore.device_memory
    assert "cuda" not in kvflow.MooncakeStore.device_memory  # its transfer engine copies


def _roundtrip(store: Store, device: CudaDevice) -> list[torch.Tensor]:
    caches = make_caches(3, num_blocks=16)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    cfg = kvflow.EngineConfig(chunk_blocks=2, copy_threads=1)
    tokens = np.arange(4 * BS)
    with kvflow.SyncTransferEngine(layout, store, cfg, device=device) as engine:
        save = engine.start_save([(tokens, [0, 1, 2, 3])])
        for layer in range(3):
            save.layer_written(layer, timeout=60)
        assert save.wait(timeout=60).ok
        load = engine.start_load([(tokens, [12, 13, 8, 9])])
        for layer in range(3):
            load.wait_layer(layer, timeout=60)
        assert load.wait(timeout=60).ok
    return caches


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_both_host_pools_copy_through_the_device_streams(kind: str) -> None:
    store: Store = (
        kvflow.LocalStore("8MiB") if kind == "local" else ServedSharedStore(8 << 20, pin=False)
    )
    device = CudaDevice("cpu", runtime=HostRuntime())
    try:
        caches = _roundtrip(store, device)
    finally:
        store.close()
    for c in (c.view(torch.uint8) for c in caches):  # bytes: random halves hold NaNs
        assert torch.equal(c[12:14], c[0:2]) and torch.equal(c[8:10], c[2:4])
    streams = device._streams
    assert {d for d, _ in streams} == {Direction.TO_POOL, Direction.FROM_POOL}
    assert len({id(s) for s in streams.values()}) == len(streams)  # one per thread, direction


def test_the_copy_streams_wait_on_the_callers_events_and_no_thread_does() -> None:
    waited: dict[Direction, list[Any]] = {Direction.TO_POOL: [], Direction.FROM_POOL: []}

    class Spy(torch.cpu.Stream):  # type: ignore[misc]
        def __init__(self, direction: Direction) -> None:
            super().__init__()
            self.direction = direction

        def wait_event(self, event: Any) -> None:
            waited[self.direction].append(event)

    written: list[Any] = []
    started: list[Any] = []

    class Recording(CudaDevice):
        def layer_written(self, layer: int) -> Any:
            written.append(super().layer_written(layer))
            return written[-1]

        def load_started(self) -> Any:
            started.append(super().load_started())
            return started[-1]

        def _new_stream(self, direction: Direction) -> Any:
            return Spy(direction)

    device = Recording("cpu", runtime=HostRuntime())
    caches = make_caches(2, num_blocks=8)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = kvflow.LocalStore("4MiB")
    cfg = kvflow.EngineConfig(chunk_blocks=1, copy_threads=1)
    with kvflow.SyncTransferEngine(layout, store, cfg, device=device) as engine:
        assert engine.save(np.arange(BS), [0]).ok
        assert engine.load(np.arange(BS), [3]).ok
    store.close()
    assert len(written) == 2 and waited[Direction.TO_POOL] == written  # each layer's event
    assert len(started) == 1 and waited[Direction.FROM_POOL] == started * 2  # before each copy
    device.wait_ready(written[0])  # a no-op: the streams wait, not the copy thread


def test_a_load_signals_a_layer_when_issued_and_releases_its_leases_after_the_copy() -> None:
    caches = make_caches(2, num_blocks=8)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = kvflow.LocalStore("4MiB")
    device = Gated()
    cfg = kvflow.EngineConfig(chunk_blocks=1, copy_threads=1, prefetch_layers=1)
    tokens = np.arange(BS)
    with kvflow.SyncTransferEngine(layout, store, cfg) as plain:
        assert plain.save(tokens, [0]).ok
    with kvflow.SyncTransferEngine(layout, store, cfg, device=device) as engine:
        load = engine.start_load([(tokens, [5])])
        load.wait_layer(0, timeout=60)  # returns while the copy thread still waits for its copy
        assert device.gate.passed == 0  # (the copy is not through its gate yet)
        assert device.waiting.wait(60) and not device.gate.is_set()
        assert store.usage().leases == 1  # the lease is held under the copy
        device.gate.set()
        assert load.wait(timeout=60).ok
        assert store.usage().leases == 0
    store.close()
    assert all(torch.equal(c[5].view(torch.uint8), c[0].view(torch.uint8)) for c in caches)


def test_a_failed_device_copy_fails_the_layer_and_nothing_waits_forever() -> None:
    caches = make_caches(2, num_blocks=8)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = kvflow.LocalStore("4MiB")
    cfg = kvflow.EngineConfig(chunk_blocks=1, copy_threads=1)
    tokens = np.arange(2 * BS)
    with kvflow.SyncTransferEngine(layout, store, cfg) as plain:
        assert plain.save(tokens, [0, 1]).ok
    device = CudaDevice("cpu", runtime=HostRuntime(fail_at=1))  # the second range of layer 0
    with kvflow.SyncTransferEngine(layout, store, cfg, device=device) as engine:
        load = engine.start_load([(tokens, [4, 5])])
        for layer in range(2):
            load.wait_layer(layer, timeout=60)
        result = load.wait(timeout=60)
        assert not result.ok
        assert result.count(ChunkStatus.FAILED) >= 1
        assert set(result.failed_block_ids.tolist()) <= {4, 5}
        assert "stand-in error" in str(load.handle.last_error)
        assert engine.stats().failed_chunks >= 1
    assert store.usage().leases == 0
    store.close()


class PinRecorder:
    """Stands in for ``kvflow.copying.cuda.runtime()``: records host registrations."""

    def __init__(self, refuse: bool = False) -> None:
        self.pinned: dict[int, int] = {}
        self.refuse = refuse

    def host_register(self, addr: int, nbytes: int) -> None:
        if self.refuse:
            raise kvflow.StoreError("cudaHostRegister: stand-in refusal", 1)
        self.pinned[addr] = nbytes

    def host_unregister(self, addr: int) -> None:
        del self.pinned[addr]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> PinRecorder:
    rec = PinRecorder()
    monkeypatch.setattr(kvflow.copying.cuda, "gpu_present", lambda: True)
    monkeypatch.setattr(kvflow.copying.cuda, "runtime", lambda: rec)
    return rec


def test_the_local_pool_pins_its_arena_when_a_gpu_is_present(recorder: PinRecorder) -> None:
    store = kvflow.LocalStore("2MiB")
    assert store.pinned
    assert recorder.pinned == {store._base: 2 << 20}
    assert not kvflow.LocalStore("1MiB", pin=False).pinned
    store.close()
    del store
    gc.collect()
    assert recorder.pinned == {}  # unpinned when the store went


def test_the_shared_pool_pins_its_mapping_and_unpins_before_unmapping(
    recorder: PinRecorder,
) -> None:
    store = ServedSharedStore(2 << 20)
    conn = store._conn
    assert conn is not None and conn.pinned
    assert recorder.pinned == {conn.base: 2 << 20}
    store.close()
    conn.unmap()
    assert recorder.pinned == {}


def test_a_refused_pin_is_an_error_only_when_asked_for(
    recorder: PinRecorder, caplog: pytest.LogCaptureFixture
) -> None:
    recorder.refuse = True
    assert not kvflow.LocalStore("1MiB").pinned
    assert "not pinned" in caplog.text
    with pytest.raises(kvflow.StoreError, match="stand-in refusal"):
        kvflow.LocalStore("1MiB", pin=True)


def test_pinning_without_a_gpu_is_refused_by_name() -> None:
    if kvflow.copying.cuda.gpu_present():
        pytest.skip("a GPU is present")
    assert not kvflow.LocalStore("1MiB").pinned  # the default: pinned only with a GPU
    with pytest.raises(kvflow.ConfigError, match="pin"):
        kvflow.LocalStore("1MiB", pin=True)
    with pytest.raises(kvflow.ConfigError, match="pin"):
        kvflow.LocalStore("1MiB", pin="yes")  # type: ignore[arg-type]
    with pytest.raises(kvflow.ConfigError, match="pin"):
        kvflow.SharedStoreConfig(pin="yes")  # type: ignore[arg-type]
    for store in (
        lambda: kvflow.LocalStore("1MiB", pin=1),
        lambda: kvflow.SharedStoreConfig(pin=1),
    ):
        with pytest.raises(kvflow.ConfigError, match="pin"):  # a bool, as both say
            store()
