"""Device ordering: the accelerator path (StreamDevice, torch's device-generic streams and
events, the code NPUs and CUDA GPUs run) exercised on CPU tensors through the same functions
(torch.cpu implements current_stream, Event and wait_event); which devices kvflow accepts; and
the engine refusing KV caches on a device its store cannot copy."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch

import kvflow
from kvflow.devices import StreamDevice, device_kind, device_ops
from tests.support.caches import make_caches
from tests.support.pools import memcache_standin_store
from tests.support.wrappers import WrappedStore

BS = 16


class Spy(StreamDevice):
    """StreamDevice on CPU, recording which hook ran on which thread with which token."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.log: list[tuple[str, int | None, str, Any]] = []
        self._lock = threading.Lock()

    def _note(self, what: str, layer: int | None, token: Any) -> None:
        with self._lock:
            self.log.append((what, layer, threading.current_thread().name, token))

    def layer_written(self, layer: int) -> Any:
        token = super().layer_written(layer)
        self._note("written", layer, token)
        return token

    def wait_ready(self, token: Any) -> None:
        super().wait_ready(token)
        self._note("ready", None, token)

    def layer_loaded(self, layer: int) -> Any:
        token = super().layer_loaded(layer)
        self._note("loaded", layer, token)
        return token

    def order_after(self, token: Any) -> None:
        super().order_after(token)
        self._note("ordered", None, token)


def test_the_stream_path_orders_saves_and_loads_on_cpu_tensors() -> None:
    caches = make_caches(3, num_blocks=16)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    store = WrappedStore(kvflow.LocalStore("8MiB"))
    spy = Spy()
    store.before_copy = lambda d, *a: spy._note("copy", None, d.name)
    cfg = kvflow.EngineConfig(chunk_blocks=1, copy_threads=1)
    tokens = np.arange(2 * BS)
    with kvflow.SyncTransferEngine(layout, store, cfg, device=spy) as engine:
        save = engine.start_save([(tokens, [0, 1])])
        for layer in range(3):
            save.layer_written(layer, timeout=60)
        assert save.wait(timeout=60).ok
        written = [e for e in spy.log if e[0] == "written"]
        ready = [e for e in spy.log if e[0] == "ready"]
        assert [e[1] for e in written] == [0, 1, 2]
        assert {e[2] for e in written} == {threading.current_thread().name}  # the producer's
        assert all(isinstance(e[3], torch.cpu.Event) for e in written)
        assert [e[3] for e in ready] == [e[3] for e in written]  # each save waited on its event
        assert all(e[2].startswith("kvflow-copy") for e in ready)
        steps = [e[0] for e in spy.log if e[0] in ("ready", "copy")]
        assert steps == ["ready", "copy"] * 3  # every layer's copy after its wait
        spy.log.clear()
        load = engine.start_load([(tokens, [8, 9])])
        for layer in range(3):
            load.wait_layer(layer, timeout=60)
        assert load.wait(timeout=60).ok
    loaded = [e for e in spy.log if e[0] == "loaded"]
    ordered = [e for e in spy.log if e[0] == "ordered"]
    assert sorted(e[1] for e in loaded) == [0, 1, 2]
    assert all(e[2].startswith("kvflow-copy") for e in loaded)
    assert {id(e[3]) for e in ordered} == {id(e[3]) for e in loaded}  # the caller's stream waits
    assert all(e[2] == threading.current_thread().name for e in ordered)
    for c in caches:
        assert torch.equal(c[8:10].view(torch.uint8), c[0:2].view(torch.uint8))
    store.close()


def test_device_ops_per_device() -> None:
    assert device_ops("cpu").name == "cpu" and device_ops(torch.device("cpu")).name == "cpu"
    cuda = device_ops("cuda:1")
    assert isinstance(cuda, StreamDevice) and cuda.device == torch.device("cuda:1")
    assert device_kind(torch.device("cuda", 0)) == "cuda" and device_kind("npu:3") == "npu"
    with pytest.raises(kvflow.LayoutError, match="xla"):
        device_ops("xla:0")


@pytest.mark.skipif("torch_npu" in sys.modules, reason="torch_npu is installed here")
def test_npu_needs_torch_npu_and_import_kvflow_never_imports_it() -> None:
    code = (
        "import sys, kvflow\n"
        "assert 'torch_npu' not in sys.modules\n"
        "from kvflow.devices import device_ops\n"
        "try:\n"
        "    device_ops('npu:0')\n"
        "except kvflow.MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch_npu" in out.stdout


def test_the_engine_refuses_caches_its_store_cannot_copy() -> None:
    """A MemcacheStore (over the in-memory stand-in: no Ascend hardware here) set up for NPU
    memory refuses host KV caches, naming the device; the host-memory one takes them."""
    layout = kvflow.KVLayout.from_tensors(make_caches(2), block_size=BS)
    npu = memcache_standin_store(1 << 20, local_memory="device")
    host = memcache_standin_store(1 << 20)
    try:
        assert npu.device_memory == frozenset({"npu"}) and host.device_memory == {"cpu"}
        with pytest.raises(kvflow.LayoutError, match="npu") as err:
            kvflow.TransferEngine(layout, npu)
        assert err.value.argument == "device"
        with kvflow.SyncTransferEngine(layout, host, kvflow.EngineConfig(chunk_blocks=1)):
            pass
    finally:
        npu.close()
        host.close()
