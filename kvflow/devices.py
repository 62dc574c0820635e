"""Device specifics behind one small interface: when a layer's bytes are ready to move.

The engine never asks what device it is on. It calls ``layer_written`` when the caller says a
layer's KV is written (on a GPU that would record an event on the compute stream), hands the
token to the copy thread, which calls ``wait_ready`` before touching the bytes, and calls
``layer_loaded`` after a layer's copy so the consumer can order its compute after it.

On CPU the bytes are in host memory and ready when the caller says so: every hook is a no-op and
the store copies by address.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvflow.errors import LayoutError

__all__ = ["CpuDevice", "DeviceOps", "device_ops"]


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


class CpuDevice(DeviceOps):
    """Host memory: bytes are ready when the caller says so, copies are synchronous memmoves."""

    name = "cpu"

    def layer_written(self, layer: int) -> None:
        return None

    def wait_ready(self, token: Any) -> None:
        return None

    def layer_loaded(self, layer: int) -> None:
        return None


_CPU = CpuDevice()


def device_ops(device: Any) -> DeviceOps:
    """The DeviceOps for a torch device; refuses devices kvflow cannot move bytes for yet."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cpu":
        return _CPU
    raise LayoutError("device", str(device), "kvflow moves KV for CPU tensors only in this version")
