"""Engine counters: what moved, what the store was asked, what failed, how long layers waited."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counters of one TransferEngine. Updated on the engine's loop only; ``stats()`` copies.

    ``store_metadata_calls`` counts lookup/open/finish/close calls and ``keys_touched`` the keys
    they carried; ``copy_calls`` counts the per-layer
    ``batch_copy`` calls and ``copy_ranges`` the ranges they carried. ``hit_chunks`` and
    ``miss_chunks`` count lookups; ``load_missing_chunks`` chunks gone between lookup and load.
    ``lookup_errors`` and ``store_errors`` count lookups and batch opens or ends the store
    failed. ``failed_chunks`` counts the chunks loads and saves report FAILED, each once: those
    of a batch the store could not open (down, closed, timed out), whose copy failed or timed
    out, or whose session the store could not end.
    ``layer_wait_s[i]`` sums the time consumers spent in ``wait_layer(i)``.
    """

    num_layers: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    blocks_saved: int = 0
    blocks_loaded: int = 0
    copy_calls: int = 0
    copy_ranges: int = 0
    store_metadata_calls: int = 0
    keys_touched: int = 0
    lookups: int = 0
    lookup_errors: int = 0
    store_errors: int = 0
    hit_chunks: int = 0
    miss_chunks: int = 0
    load_missing_chunks: int = 0
    saves_skipped_exists: int = 0
    saves_skipped_no_space: int = 0
    failed_chunks: int = 0
    timeouts: int = 0
    loads: int = 0
    saves: int = 0
    layer_wait_s: list[float] = field(default_factory=list)
    layer_waits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_wait_s:
            self.layer_wait_s = [0.0] * self.num_layers
            self.layer_waits = [0] * self.num_layers

    def snapshot(self) -> EngineStats:
        return EngineStats(**{**asdict(self)})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
