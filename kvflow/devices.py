"""Device specifics behind one small interface: when a layer's bytes are ready to move.

The engine never asks what device it is on. It calls ``layer_written`` when the caller says a
layer's KV is written (on an accelerator: an event recorded on the caller's current stream, the
compute stream), hands the token to the copy thread, which calls ``wait_ready`` before touching
the bytes, and calls ``layer_loaded`` after a layer's copy; the consumer's ``wait_layer`` then
calls ``order_after`` with that token, so its stream's later work runs after the copy.

On CPU the bytes are in host memory and ready when the caller says so: every hook is a no-op.
Accelerators (Ascend NPUs through ``torch_npu``, CUDA GPUs) share one implementation,
``StreamDevice``, written against torch's device-generic API (``torch.get_device_module``:
``current_stream()``, ``Event``, ``Stream.wait_event``), so the same code serves every backend
torch knows; on CPU tensors torch's ``torch.cpu`` module implements the same calls, which is how
the accelerator path is exercised where no accelerator exists.

Which device memory a store's ``batch_copy`` can address is the store's business
(``Store.local_memory``): the engine refuses a layout on a device its store cannot copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvflow.errors import LayoutError, MissingDependencyError

__all__ = ["CpuDevice", "DeviceOps", "StreamDevice", "device_kind", "device_ops"]


class DeviceOps(ABC):
    """How readiness is signalled on one kind of device. Methods may be called from any thread."""

    name: str

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


class CpuDevice(DeviceOps):
    """Host memory: bytes are ready when the caller says so, copies are synchronous memmoves."""

    name = "cpu"

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


_CPU = CpuDevice()
_ACCELERATORS = ("npu", "cuda")


def device_kind(device: Any) -> str:
    """``"cpu"``, ``"npu"``, ``"cuda"``...: the type of a torch device or its name."""
    return str(getattr(device, "type", str(device).split(":")[0]))


def device_ops(device: Any) -> DeviceOps:
    """The DeviceOps for a torch device; refuses devices kvflow cannot order transfers on.

    ``npu`` needs ``torch_npu``, imported here and only here (never at ``import kvflow``).
    """
    kind = device_kind(device)
    if kind == "cpu":
        return _CPU
    if kind not in _ACCELERATORS:
        raise LayoutError("device", str(device), f"kvflow handles cpu and {_ACCELERATORS}")
    if kind == "npu":
        try:
            import torch_npu  # type: ignore[import-not-found]  # noqa: F401  # registers npu
        except ImportError as exc:
            raise MissingDependencyError("NPU KV caches", "torch_npu (Ascend's torch)") from exc
    return StreamDevice(device)
