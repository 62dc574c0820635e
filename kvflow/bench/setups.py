"""What the copy-level scenarios measure on: small layouts, LocalStores sized for them, and the
copy set-ups (a device tensor and granted pool objects, the memcpy reference, copies spread
over an executor's threads)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from kvflow.bench.args import fmt_bytes
from kvflow.config import EngineConfig
from kvflow.layout import KVLayout
from kvflow.pipeline.addrgen import BatchAddresses, LayerRanges
from kvflow.pipeline.executor import PinnedExecutor
from kvflow.stores.arena import SLOT_ALIGN
from kvflow.stores.base import Direction, Store, WriteSession
from kvflow.stores.local import LocalStore

__all__ = [
    "CHUNK_BLOCKS",
    "DIRECTIONS",
    "LOOPS",
    "MAX_TRANSFER_BYTES",
    "CopyBench",
    "Memcpy",
    "small_layout",
    "store_for",
    "submit_copy",
]

CHUNK_BLOCKS = 16
MAX_TRANSFER_BYTES = EngineConfig().transfer_limit
DIRECTIONS = (("to_pool", Direction.TO_POOL), ("from_pool", Direction.FROM_POOL))
LOOPS = ("native", "python")  # LocalStore's copy loops: native_copy=True, native_copy=False


def store_for(layout: KVLayout, chunk_blocks: int, objects: int, **kw: Any) -> LocalStore:
    """A LocalStore with room for ``objects`` chunk objects of ``layout`` (and one spare)."""
    slot = -(-layout.object_bytes(chunk_blocks) // SLOT_ALIGN) * SLOT_ALIGN
    return LocalStore((objects + 1) * slot, **kw)


def small_layout(
    layers: int, blocks: int, block_bytes: int, seed: int = 0
) -> tuple[list[torch.Tensor], KVLayout]:
    """``layers`` random ``uint8 [blocks, block_bytes]`` tensors and their layout (16 tokens
    per block)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(0, 256, (blocks, block_bytes), generator=gen, dtype=torch.uint8)
        for _ in range(layers)
    ]
    return tensors, KVLayout.from_tensors(tensors, block_size=16)


class Memcpy:
    """The memcpy reference: one ``numpy.copyto`` of ``nbytes`` between two buffers whose pages
    are already mapped."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.full(nbytes, 7, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)

    def of(self, nbytes: int) -> Callable[[], None]:
        src, dst = self.src[:nbytes], self.dst[:nbytes]

        def copy() -> None:
            np.copyto(dst, src)

        return copy


class CopyBench:
    """A device tensor ``uint8 [n_blocks, block_bytes]`` and, for each copy loop in ``loops``
    (``"native"``, ``"python"``), a LocalStore (prefaulted, ``native_copy`` set to match)
    holding one granted object per chunk of ``chunk_blocks`` blocks: what ``batch_copy`` moves
    between. Each loop has its own pool of the same size; the device tensor is shared.

    Every block carries its id in its first and last 8 bytes, so ``verify`` catches a missing,
    misplaced or truncated block copy.
    """

    def __init__(
        self,
        block_bytes: int,
        n_blocks: int,
        chunk_blocks: int = CHUNK_BLOCKS,
        loops: Sequence[str] = ("native",),
        device: str = "cpu",
    ) -> None:
        n_blocks = max(chunk_blocks, n_blocks - n_blocks % chunk_blocks)
        self.block_bytes = block_bytes
        self.n_blocks = n_blocks
        self.nbytes = n_blocks * block_bytes
        self.chunk_blocks = chunk_blocks
        self.device = self._stamped().to(device)
        self.layout = KVLayout.from_tensors([self.device], block_size=16)
        self._pools: dict[str, tuple[LocalStore, WriteSession]] = {}
        try:
            for loop in loops:
                self._pools[loop] = self._pool(loop)
        except BaseException:
            self.close()
            raise

    def _pool(self, loop: str) -> tuple[LocalStore, WriteSession]:
        if loop not in LOOPS:
            raise ValueError(f"copy loop {loop!r}: expected one of {LOOPS}")
        n_chunks = self.n_blocks // self.chunk_blocks
        store = store_for(
            self.layout,
            self.chunk_blocks,
            n_chunks,
            prefault=True,
            native_copy=loop == "native",
            pin=self.layout.device != "cpu",  # CPU rows on a GPU machine: pageable, as ever
        )
        store.register(self.layout.regions())
        obj = self.layout.object_bytes(self.chunk_blocks)
        session = store.open_write([f"copy/{i}" for i in range(n_chunks)], obj)
        if not session.granted.all():
            store.close()
            raise RuntimeError("the copy benchmark's store did not grant every object")
        return store, session

    def _stamped(self) -> torch.Tensor:
        blocks = np.empty((self.n_blocks, self.block_bytes), dtype=np.uint8)
        blocks[:] = np.random.default_rng(0).integers(0, 256, blocks.shape[1], dtype=np.uint8)
        ids = np.arange(self.n_blocks, dtype=np.int64).view(np.uint8).reshape(-1, 8)
        blocks[:, :8] = ids
        blocks[:, -8:] = ids
        return torch.from_numpy(blocks)

    def store(self, loop: str = "native") -> LocalStore:
        """The pool of copy loop ``loop``."""
        return self._pools[loop][0]

    def ranges(self, coalesced: bool, seed: int = 0, loop: str = "native") -> LayerRanges:
        """The layer's ranges into ``loop``'s pool for block ids in order (coalesced per chunk)
        or a random permutation (one range per block)."""
        ids = (
            np.arange(self.n_blocks, dtype=np.int64)
            if coalesced
            else np.random.default_rng(seed).permutation(self.n_blocks).astype(np.int64)
        )
        addrs = BatchAddresses(
            self.layout, ids, self._pools[loop][1].addrs, self.chunk_blocks, MAX_TRANSFER_BYTES
        )
        return addrs.layer(0)

    def verify(self, ranges: LayerRanges, loop: str = "native", store: Any = None) -> None:
        """Round-trip every block through ``loop``'s pool (or ``store``, something with its
        ``batch_copy``) and check the stamps."""
        store = store or self.store(loop)
        store.batch_copy(ranges.pool, ranges.local, ranges.sizes, Direction.TO_POOL)
        self.device.zero_()
        store.batch_copy(ranges.pool, ranges.local, ranges.sizes, Direction.FROM_POOL)
        blocks = self.device.cpu().numpy()
        ids = np.arange(self.n_blocks, dtype=np.int64)
        head = np.ascontiguousarray(blocks[:, :8]).view(np.int64).reshape(-1)
        tail = np.ascontiguousarray(blocks[:, -8:]).view(np.int64).reshape(-1)
        if not (np.array_equal(head, ids) and np.array_equal(tail, ids)):
            raise RuntimeError(
                f"a round trip of {fmt_bytes(self.block_bytes)} blocks lost data ({loop} loop)"
            )

    def close(self) -> None:
        for store, session in self._pools.values():
            store.finish_write(session, np.zeros(len(session.keys), dtype=bool))
            store.close()
        self._pools.clear()


def submit_copy(
    store: Store, ranges: LayerRanges, direction: Direction, executor: PinnedExecutor
) -> Callable[[], None]:
    """A call that copies ``ranges`` on the executor's threads and waits: the ranges are cut
    into one piece per thread, of about equal bytes, each piece one ``batch_copy`` (as the
    engine's copy threads each run one layer's ``batch_copy``)."""
    ends = np.cumsum(ranges.sizes)
    total = int(ends[-1]) if ends.size else 0
    cuts = np.searchsorted(
        ends, [total * k // executor.threads for k in range(1, executor.threads)]
    )
    bounds = [0, *sorted({int(c) + 1 for c in cuts if c + 1 < len(ranges)}), len(ranges)]
    pieces = [
        (ranges.pool[a:b].copy(), ranges.local[a:b].copy(), ranges.sizes[a:b].copy())
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]

    def copy() -> None:
        futures: list[Future[np.ndarray]] = [
            executor.submit(store.batch_copy, pool, local, sizes, direction)
            for pool, local, sizes in pieces
        ]
        for future in futures:
            if future.result().size:
                raise RuntimeError("batch_copy reported failed ranges")

    return copy
