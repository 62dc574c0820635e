"""The layerwise pipeline: batch planning, address generation, copy executor, engine, handles."""

from kvflow.pipeline.engine import TransferEngine
from kvflow.pipeline.handles import LoadHandle, SaveHandle
from kvflow.pipeline.sync import SyncLoadHandle, SyncSaveHandle, SyncTransferEngine

__all__ = [
    "LoadHandle",
    "SaveHandle",
    "SyncLoadHandle",
    "SyncSaveHandle",
    "SyncTransferEngine",
    "TransferEngine",
]
