"""The timed runs of ``kvflow bench ttft`` on its synthetic model (``model.py``).

``TtftBench`` holds one model, one pool and the prompt's block tables; each of its runs times
one TTFT: ``hbm_run`` with the prefix KV already in the device cache, ``load_run`` with the
prefix loaded from the pool through kvflow (layerwise, or every layer first). The scenario
(``ttft.py``) interleaves them; ``ttft_report.py`` sums them up.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvflow.bench.model import ModelShape, PagedModel
from kvflow.config import EngineConfig
from kvflow.errors import ConfigError, KVFlowError
from kvflow.pipeline.sync import SyncTransferEngine
from kvflow.stores.base import Direction
from kvflow.stores.local import LocalStore
from kvflow.testing import InstrumentedStore

__all__ = ["MODES", "TtftBench"]

MODES = ("hbm_hit", "layerwise", "non_layerwise", "recompute")


class TtftBench:
    """One model, one pool, the prompt's block tables, and the timed modes."""

    def __init__(self, args: argparse.Namespace, shape: ModelShape) -> None:
        bs, chunk_tokens = shape.block_size, args.chunk_blocks * shape.block_size
        if args.new_tokens:
            prefix = max(0, (args.tokens - args.new_tokens) // chunk_tokens * chunk_tokens)
            total = prefix + args.new_tokens
        else:
            total = args.tokens
            prefix = int(args.tokens * args.hit_rate) // chunk_tokens * chunk_tokens
        if prefix == 0 or prefix >= total:
            reason = f"no cacheable prefix: {prefix} tokens in whole chunks"
            raise ConfigError("tokens", total, reason)
        self.shape, self.total, self.prefix = shape, total, prefix
        n_all, n_pre = -(-total // bs), prefix // bs
        self.device = torch.device(args.device)
        self.model = PagedModel(shape, 2 * n_all, seed=args.seed, device=args.device)
        self.tokens = torch.from_numpy(
            np.random.default_rng(args.seed).integers(0, 1 << 30, total, dtype=np.int64)
        )
        # hbm_hit and recompute use blocks [0, n_all); loads bring the prefix into the fresh
        # blocks [n_all, n_all + n_pre) and compute the new tokens right after them
        self.hbm_first, self.load_first = 0, n_all
        self.hbm_blocks = torch.arange(n_all)
        self.load_blocks = torch.arange(n_all, n_all + n_pre)
        self.all_pos = torch.arange(total, device=self.device)
        self.new_pos = torch.arange(prefix, total, device=self.device)
        self.pool_bytes = shape.kv_bytes_per_token_layer * prefix * shape.layers + (64 << 20)
        self.store = InstrumentedStore(LocalStore(4096))  # replaced by run()'s pool

    def forward(
        self,
        first_block: int,
        positions: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
        spans: list[tuple[float, float]] | None = None,
    ) -> torch.Tensor:
        """Run every layer for the tokens at ``positions``; returns their final hidden states
        once computed (on a GPU: after a synchronize). ``spans``: per layer, when its compute
        ran (perf_counter seconds; on a GPU from CUDA events, placed on the same clock)."""
        clock = _GpuClock() if self.device.type == "cuda" else None
        now: Callable[[], Any] = clock.mark if clock else time.perf_counter
        marks = []
        x = self.model.embed_tokens(self.tokens[positions.cpu()])
        for i in range(self.shape.layers):
            if before_layer is not None:
                before_layer(i)
            start = now()
            x = self.model.layer(i, x, positions, first_block, self.total)
            marks.append((start, now()))
        if clock is not None:
            torch.cuda.synchronize()
            marks = [(clock.time(a), clock.time(b)) for a, b in marks]
        if spans is not None:
            spans.extend(marks)
        return x

    def clear_load_blocks(self) -> None:
        """Zero the blocks a load fills, so a load that fails cannot pass for one that worked
        (an index assignment writes in place; ``cache[ids].zero_()`` would zero a copy)."""
        for cache in self.model.caches:
            if self.shape.mla_dim:
                cache[self.load_blocks] = 0
            else:
                cache[:, self.load_blocks] = 0

    def engine(self, prefetch: int, copy_cpus: tuple[int, ...], chunk_blocks: int) -> Any:
        config = EngineConfig(
            model="kvflow-bench-ttft",
            chunk_blocks=chunk_blocks,
            prefetch_layers=prefetch,
            copy_cpus=copy_cpus,
        )
        return SyncTransferEngine(self.model.layout(), self.store, config)

    def hbm_run(self) -> dict[str, Any]:
        """One timed TTFT with the prefix KV already in the device cache."""
        spans: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        out = self.forward(self.hbm_first, self.new_pos, spans=spans)
        ttft = time.perf_counter() - t0
        return {"ttft": ttft, "out": out, "compute": [(a - t0, b - t0) for a, b in spans]}

    def load_run(self, engine: Any, layerwise: bool) -> dict[str, Any]:
        """One timed TTFT through the pool; returns the output and the timeline."""
        self.clear_load_blocks()
        self.store.reset()
        spans: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        hit = engine.lookup(self.tokens)
        handle = engine.start_load(
            [(self.tokens[:hit], self.load_blocks[: hit // self.shape.block_size])]
        )
        if layerwise:
            out = self.forward(self.load_first, self.new_pos, handle.wait_layer, spans)
            result = handle.wait()
        else:
            for i in range(self.shape.layers):
                handle.wait_layer(i)
            result = handle.wait()
            out = self.forward(self.load_first, self.new_pos, spans=spans)
        ttft = time.perf_counter() - t0
        if hit != self.prefix or not result.ok:
            raise KVFlowError(f"the load failed: hit {hit} of {self.prefix} tokens, {result}")
        copies = [c for c in self.store.copies if c.direction == Direction.FROM_POOL]
        return {
            "ttft": ttft,
            "out": out,
            "compute": [(a - t0, b - t0) for a, b in spans],
            "transfer": [(c.start - t0, c.end - t0) for c in copies],
        }


class _GpuClock:
    """CUDA events on the current stream, read back as perf_counter times: ``mark()`` records
    one, ``time(event)`` (after a synchronize) is when the GPU reached it."""

    def __init__(self) -> None:
        self._origin = self.mark()  # the GPU is idle here: it reaches this event at once
        self._host = time.perf_counter()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def time(self, event: Any) -> float:
        return self._host + float(self._origin.elapsed_time(event)) / 1e3
