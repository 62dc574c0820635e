"""Device specifics behind one small interface: when a layer's bytes are ready to move.

The engine never asks what device it is on. It calls ``layer_written`` when the caller says a
layer's KV is written (on an accelerator: an event recorded on the caller's current stream, the
compute stream), hands the token to the copy thread, which runs the store's copy inside
``copying`` (a save's copy starts after the token's work), and takes a load's token from
``layer_loaded`` after the copy (or, where copies run asynchronously, from ``copying``'s
``on_issued`` as soon as they are issued); the consumer's ``wait_layer`` then calls
``order_after`` with that token, so its stream's later work runs after the copy.

On CPU the bytes are in host memory and ready when the caller says so: every hook is a no-op.
Accelerators (Ascend NPUs through ``torch_npu``, CUDA GPUs) share one implementation,
``StreamDevice``, written against torch's device-generic API (``torch.get_device_module``:
``current_stream()``, ``Event``, ``Stream.wait_event``), so the same code serves every backend
torch knows; on CPU tensors torch's ``torch.cpu`` module implements the same calls, which is how
the accelerator path is exercised where no accelerator exists.

CUDA GPUs get ``CudaDevice``: kvflow issues the host pools' copies itself, as
``cudaMemcpyAsync`` calls on a stream of its own per direction (``kvflow.copying.cuda``), so
compute stream and the copies wait on each other's events and no caller's thread waits.

Which device memory a store's ``batch_copy`` can address is the store's business
(``Store.device_memory``): the engine refuses a layout on a device its store cannot copy.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvflow.copying.host import issue_ranges, moving_with
from kvflow.errors import LayoutError, MissingDependencyError, StoreError
from kvflow.layout import DEVICE_KINDS, device_kind
from kvflow.stores.base import Direction

if TYPE_CHECKING:
    from kvflow.copying.cuda import CopyRuntime

__all__ = ["CpuDevice", "CudaDevice", "DeviceOps", "StreamDevice", "device_kind", "device_ops"]

Issued = Callable[[Any], None]  # receives a load's layer_loaded-like token once its copy is issued


class DeviceOps(ABC):
    """How readiness is signalled on one kind of device. Methods may be called from any thread."""

    name: str
    synchronous: bool = False  # see CpuDevice

    @abstractmethod
    def layer_written(self, layer: int) -> Any:
        """Called by the producer's thread when ``layer`` is written; returns a readiness token."""

    @abstractmethod
    def wait_ready(self, token: Any) -> None:
        """Called on a copy thread before a save copies; blocks until the token's work is done."""

    @abstractmethod
    def layer_loaded(self, layer: int) -> Any:
        """Called on a copy thread after a load's copy of ``layer``; returns a token the consumer
        can order its work after (CPU: None, the bytes are already in place)."""

    def order_after(self, token: Any) -> None:  # noqa: B027 - a no-op where bytes are in place
        """Called on the consumer's thread when ``wait_layer`` returns: its current stream's
        later work waits for ``token`` (``layer_loaded``'s), without blocking the thread."""

    def load_started(self) -> Any:
        """Called on the consumer's thread when a load starts; returns a token the load's
        copies wait for: work the consumer queued earlier may still use the blocks being
        loaded into. None where the consumer's earlier work is done when it returns (CPU), and
        where the store's own engine copies (NPU)."""
        return None

    @contextmanager
    def copying(
        self, direction: Direction, token: Any, on_issued: Issued | None = None
    ) -> Iterator[None]:
        """Around a store's ``batch_copy`` on a copy thread. A save's copy must not read a layer
        before ``token`` (``layer_written``'s) is done: here the thread waits (``wait_ready``).
        Devices whose copies run asynchronously call ``on_issued(token)`` as soon as a load's
        copies are issued (the token as ``layer_loaded``'s); the others leave the layer's
        token to the caller, after the copy."""
        if direction == Direction.TO_POOL:
            self.wait_ready(token)
        yield


class CpuDevice(DeviceOps):
    """Host memory: bytes are ready when the caller says so, copies are synchronous memmoves
    (``synchronous``: a save can copy a layer on the producer's thread)."""

    name = "cpu"
    synchronous = True

    def layer_written(self, layer: int) -> None:
        return None

    def wait_ready(self, token: Any) -> None:
        return None

    def layer_loaded(self, layer: int) -> None:
        return None


class StreamDevice(DeviceOps):
    """An accelerator's ordering through torch's device-generic streams and events.

    * ``layer_written``: an event recorded on the producer's current stream (the compute stream
      that wrote the layer); the copy thread's ``wait_ready`` synchronizes on it, so a save
      never reads a layer the device is still writing, and the producer never blocks.
    * ``layer_loaded``: an event recorded on the copy thread's current stream after the store's
      copy was issued there; ``order_after`` makes the consumer's current stream wait on it.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.name = self.device.type
        self._module = torch.get_device_module(self.device)

    def _stream(self) -> Any:
        return self._module.current_stream(self.device)

    def _event(self) -> Any:
        event = self._module.Event()
        event.record(self._stream())
        return event

    def layer_written(self, layer: int) -> Any:
        return self._event()

    def wait_ready(self, token: Any) -> None:
        if token is not None:
            token.synchronize()

    def layer_loaded(self, layer: int) -> Any:
        return self._event()

    def order_after(self, token: Any) -> None:
        if token is not None:
            self._stream().wait_event(token)

    def __repr__(self) -> str:
        return f"StreamDevice({str(self.device)!r})"


class CudaDevice(StreamDevice):
    """A CUDA GPU: kvflow issues the host pools' copies itself, on streams of its own.

    Inside ``copying`` the thread's host-pool copy (``copy_ranges``, once per ``batch_copy``)
    becomes one ``cudaMemcpyAsync`` per coalesced range, issued from C without the GIL, on a
    stream of kvflow's own for that copy thread and direction: loads, saves and the compute
    stream never queue behind one another, nor one copy thread's layer behind another's. A
    save's stream first waits on the compute stream's event for the layer: the GPU orders the
    two, no thread waits. A load's stream likewise waits for the work the caller had queued when
    the load started (it may still use the blocks loaded into). A load records an event on its
    stream right after issuing and hands it on (``on_issued``), so ``wait_layer`` returns at
    once and the caller's stream waits on it (``order_after``). The copy thread then waits for
    its own copies before the store goes on (a save is committed, a load's leases checked and
    released, only once its bytes have moved): that wait is on kvflow's thread, never the
    caller's, and it happens even when issuing or signalling failed.

    ``runtime`` is the CUDA runtime to issue through (default: the process's,
    ``kvflow.copying.cuda``).
    """

    def __init__(self, device: torch.device | str, runtime: CopyRuntime | None = None) -> None:
        super().__init__(device)
        self._runtime = runtime
        self._streams: dict[tuple[Direction, int], Any] = {}
        self._lock = threading.Lock()

    def wait_ready(self, token: Any) -> None:
        return None  # the copy's stream waits on the token instead (``copying``)

    def load_started(self) -> Any:
        return self._event()  # the compute stream's work so far, before the load writes

    def layer_loaded(self, layer: int) -> Any:
        """A load that issued nothing (every range failed): an event on its copy stream."""
        event = self._module.Event()
        event.record(self._copy_stream(Direction.FROM_POOL))
        return event

    @contextmanager
    def copying(
        self, direction: Direction, token: Any, on_issued: Issued | None = None
    ) -> Iterator[None]:
        if self.name == "cuda":  # the copies and their events on this GPU, not device 0
            torch.cuda.set_device(self.device)
        stream = self._copy_stream(direction)
        if token is not None:  # a save: the layer written; a load: the caller's earlier work
            stream.wait_event(token)
        with moving_with(self._mover(stream, on_issued)):
            yield

    def _copy_stream(self, direction: Direction) -> Any:
        """This copy thread's stream for ``direction``, made on first use."""
        key = (direction, threading.get_ident())
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = self._new_stream(direction)
            return stream

    def _new_stream(self, direction: Direction) -> Any:
        if self.name == "cuda":
            return torch.cuda.Stream(device=self.device)
        return self._module.Stream()  # torch.cpu's, where tests stand in for a GPU

    def _copy_event(self) -> Any:
        """The event a copy thread waits on: blocking (it sleeps instead of spinning)."""
        return torch.cuda.Event(blocking=True) if self.name == "cuda" else self._module.Event()

    def _mover(
        self, stream: Any, on_issued: Issued | None
    ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
        from kvflow.copying import cuda

        rt = self._runtime or cuda.runtime()
        handle = int(getattr(stream, "cuda_stream", 0))
        calls = 0

        def move(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
            nonlocal calls
            calls += 1
            if calls > 1:  # a second batch would be signalled as issued before it was
                raise StoreError("a store copied twice in one batch_copy on a CUDA device")
            failed, error = issue_ranges(
                rt.memcpy_async_addr, dst, src, sizes, handle, cuda.MEMCPY_DEFAULT
            )
            event = self._copy_event()
            recorded = False
            try:
                event.record(stream)
                recorded = True
                if failed < 0 and on_issued is not None:
                    on_issued(event)
            finally:  # whatever was issued is done before the store goes on
                if recorded:
                    event.synchronize()
                else:  # rare: the whole device, rather than release memory under a copy
                    self._module.synchronize(self.device)
            if failed >= 0:
                raise StoreError(
                    f"cudaMemcpyAsync of range {failed} ({int(sizes[failed])} bytes at "
                    f"{int(dst[failed]):#x}): {rt.error_string(error)}",
                    error,
                )

        return move

    def __repr__(self) -> str:
        return f"CudaDevice({str(self.device)!r})"


_CPU = CpuDevice()


def device_ops(device: Any) -> DeviceOps:
    """The DeviceOps for a torch device; refuses devices kvflow cannot order transfers on.

    ``npu`` needs ``torch_npu``, imported here and only here (never at ``import kvflow``).
    """
    kind = device_kind(device)
    if kind == "cpu":
        return _CPU
    if kind not in DEVICE_KINDS:
        raise LayoutError("device", str(device), f"kvflow handles {DEVICE_KINDS}")
    if kind == "npu":
        try:
            import torch_npu  # type: ignore[import-not-found]  # noqa: F401  # registers npu
        except ImportError as exc:
            raise MissingDependencyError("NPU KV caches", "torch_npu (Ascend's torch)") from exc
        return StreamDevice(device)
    return CudaDevice(device)
