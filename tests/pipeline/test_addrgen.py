"""Address generation: BatchAddresses against the per-block reference and the pool layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow import SKIP_BLOCK, KVLayout
from kvflow.layout import KVPart
from kvflow.pipeline.addrgen import BatchAddresses, LayerRanges, reference_layer_ranges

PROPERTY = settings(max_examples=150, deadline=None)


def _layout(layers: list[list[KVPart]], num_blocks: int) -> KVLayout:
    return KVLayout(
        layers=tuple(tuple(parts) for parts in layers),
        num_blocks=num_blocks,
        block_size=1,
        dtype="uint8",
        device="cpu",
        kind="blocks",
    )


def _part(base: int, stride: int, block_bytes: int) -> KVPart:
    return KVPart(base=base, block_stride=stride, block_bytes=block_bytes, block_shape=(1,))


@dataclass(frozen=True)
class Case:
    layout: KVLayout
    block_ids: np.ndarray
    object_bases: np.ndarray
    chunk_blocks: int
    max_bytes: int

    @property
    def num_chunks(self) -> int:
        return int(self.object_bases.shape[0])

    def addresses(self) -> BatchAddresses:
        return BatchAddresses(
            self.layout, self.block_ids, self.object_bases, self.chunk_blocks, self.max_bytes
        )


@st.composite
def part_signatures(draw: st.DrawFn) -> list[tuple[int, int]]:
    """1-3 parts as (block_stride, block_bytes), stride >= block_bytes (often equal)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        block_bytes = draw(st.integers(1, 12))
        gap = draw(st.one_of(st.just(0), st.integers(1, 20)))
        out.append((block_bytes + gap, block_bytes))
    return out


@st.composite
def block_id_lists(draw: st.DrawFn, num_blocks: int, count: int) -> list[int]:
    """Runs of consecutive ids, shuffled ids or arbitrary ids (repeats allowed); sometimes some
    places are SKIP_BLOCK (a load's places the caller holds)."""
    style = draw(st.sampled_from(["runs", "shuffled", "any"]))
    ids: list[int] = []
    if style == "runs":
        while len(ids) < count:
            start = draw(st.integers(0, num_blocks - 1))
            length = draw(st.integers(1, min(num_blocks - start, count)))
            ids.extend(range(start, start + length))
    elif style == "shuffled":
        while len(ids) < count:
            ids.extend(draw(st.permutations(range(num_blocks))))
    else:
        ids = draw(st.lists(st.integers(0, num_blocks - 1), min_size=count, max_size=count))
    ids = ids[:count]
    if draw(st.booleans()):
        for i in draw(st.lists(st.integers(0, count - 1), max_size=count)):
            ids[i] = SKIP_BLOCK
    return ids


@st.composite
def cases(draw: st.DrawFn, *, max_layers: int = 8, small_max_bytes: bool = False) -> Case:
    signatures = draw(st.lists(part_signatures(), min_size=1, max_size=3))
    num_layers = draw(st.integers(1, max_layers))
    num_blocks = draw(st.integers(1, 40))
    layers = []
    for _ in range(num_layers):
        sig = draw(st.sampled_from(signatures))
        layers.append([_part(draw(st.integers(0, 1 << 20)), stride, size) for stride, size in sig])
    layout = _layout(layers, num_blocks)
    chunk_blocks = draw(st.integers(1, 8))
    n_chunks = draw(st.integers(1, 6))
    ids = draw(block_id_lists(num_blocks, n_chunks * chunk_blocks))
    spacing = layout.object_bytes(chunk_blocks) + draw(st.sampled_from([0, 0, 1, 64]))
    order = draw(st.permutations(range(n_chunks)))
    first = draw(st.integers(0, 1 << 30))
    object_bases = np.array([first + i * spacing for i in order], np.int64)
    if small_max_bytes:
        max_bytes = draw(st.integers(1, 64))
    else:
        max_bytes = draw(st.one_of(st.integers(1, 64), st.just(1 << 40)))
    return Case(layout, np.array(ids, np.int64), object_bases, chunk_blocks, max_bytes)


def _expected_byte_map(case: Case, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(pool bytes, local bytes) of one layer per the documented object layout, sorted by pool.

    A pool object is ``[layer][part][block in chunk]``: layer L starts at the sum of the earlier
    layers' block bytes times chunk_blocks, part p of it at the earlier parts' block bytes times
    chunk_blocks, and position j of a part at ``j * block_bytes``.
    """
    layout, cb = case.layout, case.chunk_blocks
    layer_start = sum(sum(p.block_bytes for p in layout.layers[i]) for i in range(layer)) * cb
    pool: list[np.ndarray] = []
    local: list[np.ndarray] = []
    for c in range(case.num_chunks):
        part_start = 0
        for p in layout.layers[layer]:
            for j in range(cb):
                block = int(case.block_ids[c * cb + j])
                if block == SKIP_BLOCK:
                    continue
                k = np.arange(p.block_bytes, dtype=np.int64)
                pool.append(
                    int(case.object_bases[c]) + layer_start + part_start + j * p.block_bytes + k
                )
                local.append(p.base + block * p.block_stride + k)
            part_start += p.block_bytes * cb
    none = np.zeros(0, np.int64)
    pool_bytes, local_bytes = np.concatenate([none, *pool]), np.concatenate([none, *local])
    order = np.argsort(pool_bytes, kind="stable")
    return pool_bytes[order], local_bytes[order]


def _expand(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Every byte address of the ranges, range after range."""
    total = int(sizes.sum())
    first = np.cumsum(sizes) - sizes
    return np.repeat(starts - first, sizes) + np.arange(total, dtype=np.int64)


def _actual_byte_map(ranges: LayerRanges) -> tuple[np.ndarray, np.ndarray]:
    pool = _expand(ranges.pool, ranges.sizes)
    local = _expand(ranges.local, ranges.sizes)
    order = np.argsort(pool, kind="stable")
    return pool[order], local[order]


# -- against the reference --------------------------------------------------------------------


@PROPERTY
@given(cases())
def test_every_layer_equals_the_reference_ranges(case: Case) -> None:
    addresses = case.addresses()

    for layer in range(case.layout.num_layers):
        got = addresses.layer(layer)
        loc, poo, siz, chk = reference_layer_ranges(
            case.layout,
            layer,
            case.block_ids.tolist(),
            case.object_bases.tolist(),
            case.chunk_blocks,
            case.max_bytes,
        )
        assert got.local.tolist() == loc
        assert got.pool.tolist() == poo
        assert got.sizes.tolist() == siz
        assert got.chunk.tolist() == chk
        for arr in (got.local, got.pool, got.sizes, got.chunk):
            assert arr.dtype == np.int64
        assert len(got) == len(siz)
        assert got.nbytes == sum(siz)


# -- against the documented pool layout -------------------------------------------------------


@PROPERTY
@given(cases(max_layers=4))
def test_ranges_move_exactly_the_bytes_of_the_documented_layout(case: Case) -> None:
    addresses = case.addresses()

    for layer in range(case.layout.num_layers):
        ranges = addresses.layer(layer)
        want_pool, want_local = _expected_byte_map(case, layer)
        got_pool, got_local = _actual_byte_map(ranges)

        assert np.unique(got_pool).shape == got_pool.shape  # no pool byte written twice
        assert np.array_equal(got_pool, want_pool)
        assert np.array_equal(got_local, want_local)
        written = int(np.count_nonzero(case.block_ids != SKIP_BLOCK))
        assert ranges.nbytes == written * case.layout.layer_block_bytes(layer)


@PROPERTY
@given(cases(small_max_bytes=True))
def test_no_range_exceeds_max_bytes_or_leaves_its_chunk(case: Case) -> None:
    addresses = case.addresses()
    offsets = case.layout.layer_offsets(case.chunk_blocks)

    for layer in range(case.layout.num_layers):
        ranges = addresses.layer(layer)
        written = case.block_ids.reshape(case.num_chunks, -1) != SKIP_BLOCK
        assert set(ranges.chunk.tolist()) == set(np.flatnonzero(written.any(axis=1)).tolist())
        if not len(ranges):
            continue
        assert ranges.sizes.min() >= 1
        assert ranges.sizes.max() <= case.max_bytes
        # a range lies inside its chunk's slice of this layer in its chunk's object
        lo = case.object_bases[ranges.chunk] + offsets[layer]
        hi = lo + case.chunk_blocks * case.layout.layer_block_bytes(layer)
        assert np.all(ranges.pool >= lo)
        assert np.all(ranges.pool + ranges.sizes <= hi)


# -- coalescing -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_blocks", [1, 3, 8])
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1]])
def test_consecutive_blocks_of_a_single_part_give_one_range_per_chunk(
    chunk_blocks: int, order: list[int]
) -> None:
    layout = _layout([[_part(1000, 16, 16)], [_part(90_000, 16, 16)]], num_blocks=40)
    n_chunks = 4
    bases = np.array([5000 + i * layout.object_bytes(chunk_blocks) for i in order], np.int64)
    ids = np.arange(n_chunks * chunk_blocks, dtype=np.int64) + 3

    addresses = BatchAddresses(layout, ids, bases, chunk_blocks, max_bytes=1 << 30)

    for layer, base in ((0, 1000), (1, 90_000)):
        ranges = addresses.layer(layer)
        assert ranges.chunk.tolist() == list(range(n_chunks))
        assert ranges.sizes.tolist() == [chunk_blocks * 16] * n_chunks
        assert ranges.local.tolist() == [
            base + (3 + c * chunk_blocks) * 16 for c in range(n_chunks)
        ]
        assert ranges.pool.tolist() == [
            int(bases[c]) + layer * chunk_blocks * 16 for c in range(n_chunks)
        ]


def test_adjacent_chunks_are_not_merged_even_when_contiguous_on_both_sides() -> None:
    layout = _layout([[_part(0, 8, 8)]], num_blocks=16)
    # chunk 1 follows chunk 0 both on the device and in the pool
    addresses = BatchAddresses(
        layout, np.arange(8, dtype=np.int64), np.array([100, 132], np.int64), 4, 1 << 30
    )

    ranges = addresses.layer(0)

    assert ranges.local.tolist() == [0, 32]
    assert ranges.pool.tolist() == [100, 132]
    assert ranges.sizes.tolist() == [32, 32]
    assert ranges.chunk.tolist() == [0, 1]


def test_consecutive_blocks_of_two_parts_give_one_range_per_part_per_chunk() -> None:
    k, v = _part(0, 4, 4), _part(10_000, 4, 4)
    layout = _layout([[k, v]], num_blocks=16)
    ids = np.array([4, 5, 6, 0, 1, 2], np.int64)

    ranges = BatchAddresses(layout, ids, np.array([500, 0], np.int64), 3, 1 << 30).layer(0)

    assert ranges.local.tolist() == [16, 10_016, 0, 10_000]
    assert ranges.pool.tolist() == [500, 512, 0, 12]
    assert ranges.sizes.tolist() == [12, 12, 12, 12]
    assert ranges.chunk.tolist() == [0, 0, 1, 1]


def test_strided_blocks_are_not_coalesced() -> None:
    layout = _layout([[_part(0, 32, 8)]], num_blocks=16)

    ranges = BatchAddresses(
        layout, np.array([0, 1, 2], np.int64), np.array([0], np.int64), 3, 1 << 30
    ).layer(0)

    assert ranges.local.tolist() == [0, 32, 64]
    assert ranges.pool.tolist() == [0, 8, 16]
    assert ranges.sizes.tolist() == [8, 8, 8]


def test_a_break_in_the_block_run_starts_a_new_range() -> None:
    layout = _layout([[_part(0, 8, 8)]], num_blocks=16)

    ranges = BatchAddresses(
        layout, np.array([3, 4, 9, 10], np.int64), np.array([0], np.int64), 4, 1 << 30
    ).layer(0)

    assert ranges.local.tolist() == [24, 72]
    assert ranges.pool.tolist() == [0, 16]
    assert ranges.sizes.tolist() == [16, 16]


def test_long_ranges_are_split_at_max_bytes() -> None:
    layout = _layout([[_part(0, 16, 16)]], num_blocks=8)

    ranges = BatchAddresses(
        layout, np.arange(4, dtype=np.int64), np.array([1000], np.int64), 4, max_bytes=24
    ).layer(0)

    assert ranges.sizes.tolist() == [24, 24, 16]
    assert ranges.local.tolist() == [0, 24, 48]
    assert ranges.pool.tolist() == [1000, 1024, 1048]
    assert ranges.chunk.tolist() == [0, 0, 0]


def test_layers_with_different_parts_use_their_own_offsets() -> None:
    layout = _layout(
        [[_part(0, 4, 4)], [_part(1000, 8, 2), _part(2000, 6, 6)], [_part(3000, 4, 4)]],
        num_blocks=8,
    )
    ids = np.array([1, 2], np.int64)
    addresses = BatchAddresses(layout, ids, np.array([0], np.int64), 2, 1 << 30)

    # object: layer 0 = 2*4 bytes, layer 1 = 2*2 + 2*6 bytes, layer 2 = 2*4 bytes
    assert addresses.layer(0).pool.tolist() == [0]
    assert addresses.layer(1).local.tolist() == [1008, 1016, 2006]
    assert addresses.layer(1).pool.tolist() == [8, 10, 12]
    assert addresses.layer(1).sizes.tolist() == [2, 2, 12]
    assert addresses.layer(2).local.tolist() == [3004]
    assert addresses.layer(2).pool.tolist() == [24]
    assert addresses.layer(2).sizes.tolist() == [8]


def test_an_empty_batch_has_no_ranges() -> None:
    layout = _layout([[_part(0, 8, 8)], [_part(100, 8, 8)]], num_blocks=4)

    addresses = BatchAddresses(
        layout, np.zeros(0, np.int64), np.zeros(0, np.int64), 4, max_bytes=64
    )

    for layer in range(2):
        ranges = addresses.layer(layer)
        assert len(ranges) == 0
        assert ranges.nbytes == 0
