"""Address generation: pure NumPy, no I/O, no threads.

For a request batch the engine knows, once, which device blocks go to which pool object and at
which position in it. From that, every layer's copy list is ``(local address, pool address,
size)``: ``part.base + block_id * part.block_stride`` on the device side and
``object_base + layer_offset + part_offset + position * part.block_bytes`` on the pool side.

Layers whose parts have the same strides and sizes share one *template*: the coalesced and split
ranges relative to the part bases and the object bases. Building a layer's list is then two
vector additions. Ranges are coalesced only inside one chunk, so a failed copy is always
attributed to exactly one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvflow.layout import SKIP_BLOCK, KVLayout

__all__ = [
    "BatchAddresses",
    "LayerRanges",
    "RangeTemplate",
    "build_template",
    "reference_layer_ranges",
]

Signature = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LayerRanges:
    """One layer's copies: parallel int64 arrays, and the batch chunk index of each range."""

    local: np.ndarray
    pool: np.ndarray
    sizes: np.ndarray
    chunk: np.ndarray

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


@dataclass(frozen=True)
class RangeTemplate:
    """Coalesced, split ranges relative to part bases (local) and object bases (pool)."""

    part: np.ndarray
    local_rel: np.ndarray
    pool_rel: np.ndarray
    sizes: np.ndarray
    chunk: np.ndarray


def build_template(
    parts: tuple[tuple[int, int], ...],
    block_ids: np.ndarray,
    chunk_blocks: int,
    max_bytes: int,
) -> RangeTemplate:
    """Ranges of one layer signature for a batch of whole chunks.

    ``parts`` is ``((block_stride, block_bytes), ...)``; ``block_ids`` lists the device blocks of
    the batch's chunks in order, ``chunk_blocks`` per chunk; a ``SKIP_BLOCK`` place gets no
    range. Ranges contiguous on both sides inside one chunk and one part are merged, then cut to
    at most ``max_bytes``.
    """
    n = block_ids.shape[0]
    n_chunks = n // chunk_blocks
    n_parts = len(parts)
    strides = np.array([s for s, _ in parts], np.int64)[:, None]
    sizes = np.array([b for _, b in parts], np.int64)[:, None]
    part_off = np.concatenate([[0], np.cumsum(sizes[:-1, 0])]) * chunk_blocks
    pos = np.tile(np.arange(chunk_blocks, dtype=np.int64), n_chunks)
    # (parts, blocks) grids, then reordered chunk-major: [chunk][part][position]
    local = block_ids[None, :] * strides
    pool = part_off[:, None] + pos[None, :] * sizes
    size = np.broadcast_to(sizes, (n_parts, n))
    part = np.broadcast_to(np.arange(n_parts, dtype=np.int64)[:, None], (n_parts, n))
    chunk = np.broadcast_to(
        np.repeat(np.arange(n_chunks, dtype=np.int64), chunk_blocks), (n_parts, n)
    )

    def order(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(
            a.reshape(n_parts, n_chunks, chunk_blocks).transpose(1, 0, 2)
        ).reshape(-1)

    local, pool, size, part, chunk = (order(a) for a in (local, pool, size, part, chunk))
    written = order(np.broadcast_to(block_ids[None, :], (n_parts, n))) != SKIP_BLOCK
    if not written.all():
        local, pool, size, part, chunk = (a[written] for a in (local, pool, size, part, chunk))
    local, pool, size, part, chunk = _coalesce(local, pool, size, part, chunk)
    local, pool, size, part, chunk = _split(local, pool, size, part, chunk, max_bytes)
    return RangeTemplate(part=part, local_rel=local, pool_rel=pool, sizes=size, chunk=chunk)


def _coalesce(
    local: np.ndarray, pool: np.ndarray, size: np.ndarray, part: np.ndarray, chunk: np.ndarray
) -> tuple[np.ndarray, ...]:
    if local.shape[0] == 0:
        return local, pool, size, part, chunk
    ends_local = local[:-1] + size[:-1]
    ends_pool = pool[:-1] + size[:-1]
    joins = (
        (local[1:] == ends_local)
        & (pool[1:] == ends_pool)
        & (chunk[1:] == chunk[:-1])
        & (part[1:] == part[:-1])
    )
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    return (
        local[starts],
        pool[starts],
        np.add.reduceat(size, starts),
        part[starts],
        chunk[starts],
    )


def _split(
    local: np.ndarray,
    pool: np.ndarray,
    size: np.ndarray,
    part: np.ndarray,
    chunk: np.ndarray,
    max_bytes: int,
) -> tuple[np.ndarray, ...]:
    if size.shape[0] == 0 or size.max() <= max_bytes:
        return local, pool, size, part, chunk
    pieces = -(-size // max_bytes)
    run = np.repeat(np.arange(size.shape[0]), pieces)
    first = np.cumsum(pieces) - pieces
    offset = (np.arange(run.shape[0]) - first[run]) * max_bytes
    new_size = np.minimum(size[run] - offset, max_bytes)
    return local[run] + offset, pool[run] + offset, new_size, part[run], chunk[run]


class BatchAddresses:
    """Every layer's copy ranges for one request batch; built once, queried per layer.

    ``block_ids`` are the device blocks of the batch's chunks in order (``chunk_blocks`` each) and
    ``object_bases`` the pool base address of each chunk. Not thread-safe to build; ``layer()``
    only reads and may be called from any thread.
    """

    def __init__(
        self,
        layout: KVLayout,
        block_ids: np.ndarray,
        object_bases: np.ndarray,
        chunk_blocks: int,
        max_bytes: int,
    ) -> None:
        self._bases = layout.part_bases
        self._layer_off = layout.layer_offsets(chunk_blocks)
        self._object_bases = np.asarray(object_bases, np.int64)
        self._signature = layout.signatures
        self._templates = {
            sig: build_template(sig, block_ids, chunk_blocks, max_bytes)
            for sig in set(self._signature)
        }

    def layer(self, layer: int) -> LayerRanges:
        t = self._templates[self._signature[layer]]
        bases = self._bases[layer]
        local = (bases[t.part] if bases.shape[0] > 1 else bases[0]) + t.local_rel
        pool = self._object_bases[t.chunk] + (self._layer_off[layer] + t.pool_rel)
        return LayerRanges(local=local, pool=pool, sizes=t.sizes, chunk=t.chunk)


def reference_layer_ranges(
    layout: KVLayout,
    layer: int,
    block_ids: list[int],
    object_bases: list[int],
    chunk_blocks: int,
    max_bytes: int,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The same ranges as ``BatchAddresses.layer``, built per block with Python lists.

    The slow, obviously-correct reference used by the tests and the address-generation benchmark.
    """
    parts = layout.layers[layer]
    layer_off = sum(layout.layer_block_bytes(i) for i in range(layer)) * chunk_blocks
    out: list[list[int]] = []
    for c, obj in enumerate(object_bases):
        part_off = 0
        for part in parts:
            for j in range(chunk_blocks):
                b = block_ids[c * chunk_blocks + j]
                if b == SKIP_BLOCK:
                    continue
                local = part.base + b * part.block_stride
                pool = obj + layer_off + part_off + j * part.block_bytes
                prev = out[-1] if out else None
                if (
                    prev is not None
                    and j > 0
                    and prev[0] + prev[2] == local
                    and prev[1] + prev[2] == pool
                ):
                    prev[2] += part.block_bytes
                else:
                    out.append([local, pool, part.block_bytes, c])
            part_off += part.block_bytes * chunk_blocks
    loc: list[int] = []
    poo: list[int] = []
    siz: list[int] = []
    chk: list[int] = []
    for local, pool, size, c in out:
        off = 0
        while off < size:
            n = min(max_bytes, size - off)
            loc.append(local + off)
            poo.append(pool + off)
            siz.append(n)
            chk.append(c)
            off += n
    return loc, poo, siz, chk
