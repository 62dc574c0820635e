"""MooncakeStore's planning without Mooncake: virtual addresses, slots, a layer's copy sorted
out, and the legacy save's whole objects."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.errors import InvalidArgumentError, StoreError
from kvflow.stores.mooncake import slots as sl
from kvflow.stores.mooncake.legacy import whole_objects


def test_addresses_decode_to_slot_and_offset() -> None:
    pool = np.array([sl.address(3) + 16, sl.address(0), sl.address(7) + 100], dtype=np.int64)
    slots, offsets = sl.decode(pool, np.array([8, 8, 8], dtype=np.int64))
    assert slots.tolist() == [3, 0, 7]
    assert offsets.tolist() == [16, 0, 100]


@pytest.mark.parametrize(
    "addr",
    [
        0x7F00_0000_1000,  # a host address: untagged
        -1,
        sl.VIRTUAL_TAG | sl.MAX_SLOTS << sl.SLOT_SHIFT,  # the spare slot
    ],
)
def test_addresses_no_store_hands_out_are_refused(addr: int) -> None:
    with pytest.raises(InvalidArgumentError, match="pool_addrs"):
        sl.decode(np.array([addr], dtype=np.int64), np.array([1], dtype=np.int64))


def test_a_range_past_the_largest_object_is_refused() -> None:
    pool = np.array([sl.address(1) + sl.MAX_OBJECT_BYTES], dtype=np.int64)
    sl.decode(pool, np.array([1], dtype=np.int64))  # the last byte
    with pytest.raises(InvalidArgumentError):
        sl.decode(pool, np.array([2], dtype=np.int64))


def test_slots_are_reused_and_remember_their_owner() -> None:
    table = sl.SlotTable()
    a, b = table.take("a", True), table.take("b", False)
    assert (a, b) == (0, 1)
    table.place(b, (0x1000, 64), until=10.0)
    assert table.resolve([a, b, 5], writing=False, now=1.0) == ({b: "b"}, {b: (0x1000, 64)})
    assert table.resolve([a, b], writing=False, now=10.0) == ({b: "b"}, {})  # window over
    assert table.resolve([a, b], writing=True, now=1.0) == ({a: "a"}, {})
    table.release(b)
    assert table.resolve([b], writing=False, now=1.0) == ({}, {})
    assert table.take("c", False) == b


def test_slots_run_out_as_a_store_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sl, "MAX_SLOTS", 2)
    table = sl.SlotTable()
    table.take("a", True)
    table.take("b", True)
    with pytest.raises(StoreError, match="objects open at once"):
        table.take("c", True)


def test_plan_copy_sorts_a_layer_out() -> None:
    slots = np.array([4, 2, 9, 4, 2], dtype=np.int64)
    offsets = np.array([0, 0, 0, 64, 64], dtype=np.int64)
    sizes = np.full(5, 64, dtype=np.int64)
    held = {4: "k4", 2: "k2"}  # slot 9 is no open session's
    local = {2: (0x5000, 128)}  # slot 2's object lies in the own segment
    failed, direct, sources, groups = sl.plan_copy(slots, offsets, sizes, held, local)
    assert failed.tolist() == [False, False, True, False, False]
    assert direct.tolist() == [1, 4]
    assert sources.tolist() == [0x5000, 0x5040]
    assert [g.tolist() for g in groups] == [[0, 3]]  # slot 4, in order


def test_plan_copy_reads_past_the_own_object_through_the_engine() -> None:
    slots = np.array([2], dtype=np.int64)
    failed, direct, _, groups = sl.plan_copy(
        slots, np.array([96]), np.array([64]), {2: "k"}, {2: (0x5000, 128)}
    )
    assert not failed.any() and direct.size == 0
    assert [g.tolist() for g in groups] == [[0]]


def test_whole_objects_put_only_what_covers_the_object() -> None:
    staged = [
        [(64, 0x2040, 64), (0, 0x2000, 64)],  # whole, out of order
        [(0, 0x3000, 64)],  # half
        [],  # nothing
        [(0, 0x4000, 64), (32, 0x4020, 96)],  # overlapping
    ]
    put, ptrs, sizes = whole_objects(staged, 128)
    assert put == [0]
    assert ptrs == [[0x2000, 0x2040]]
    assert sizes == [[64, 64]]
