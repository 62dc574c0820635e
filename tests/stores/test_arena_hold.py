"""``ArenaIndex.hold``: an object kept from eviction without taking it out of the eviction
order (what the disk tier's writer needs while it copies an object to disk), unlike a lease,
which puts it back as the newest."""

from __future__ import annotations

import numpy as np

from kvflow.stores.arena import SLOT_ALIGN, ArenaIndex
from kvflow.stores.base import WriteStatus


def full_arena() -> ArenaIndex:
    """Four slots holding a0..a3, a0 the least recently used."""
    index = ArenaIndex(4 * SLOT_ALIGN)
    for key in ("a0", "a1", "a2", "a3"):
        handle, _, status = index.open_write([key], SLOT_ALIGN)
        assert status.tolist() == [WriteStatus.GRANTED]
        index.finish_write(handle, np.ones(1, dtype=bool))
    return index


def evict_one(index: ArenaIndex, key: str) -> set[str]:
    """Write ``key``; the keys gone from the arena since."""
    before = {k for k in ("a0", "a1", "a2", "a3") if index.holds(k)}
    handle, _, status = index.open_write([key], SLOT_ALIGN)
    index.finish_write(handle, status == WriteStatus.GRANTED)
    return {k for k in before if not index.holds(k)}


def test_a_held_object_is_passed_over_and_keeps_its_place() -> None:
    index = full_arena()
    assert index.hold("a0") == (0, SLOT_ALIGN)
    assert evict_one(index, "b0") == {"a1"}  # a0 is the oldest but held
    index.release("a0")
    assert evict_one(index, "b1") == {"a0"}  # still the oldest: the hold did not move it


def test_a_lease_instead_puts_the_object_back_as_the_newest() -> None:
    index = full_arena()
    handle, *_ = index.open_read(["a0"])
    index.close_read(handle)
    assert evict_one(index, "b0") == {"a1"}
    assert evict_one(index, "b1") == {"a2"}  # a0 now newer than a2 and a3


def test_a_held_object_is_never_evicted() -> None:
    index = full_arena()
    for key in ("a0", "a1", "a2", "a3"):
        assert index.hold(key) is not None
    handle, _, status = index.open_write(["b0"], SLOT_ALIGN)
    assert status.tolist() == [WriteStatus.NO_SPACE]
    index.finish_write(handle, np.zeros(1, dtype=bool))
    assert all(index.holds(k) for k in ("a0", "a1", "a2", "a3"))


def test_a_touch_still_moves_a_held_object() -> None:
    index = full_arena()
    index.hold("a0")
    index.lookup(["a0"])  # the newest now, held or not
    index.release("a0")
    assert evict_one(index, "b0") == {"a1"}
    assert evict_one(index, "b1") == {"a2"}


def test_only_committed_objects_can_be_held() -> None:
    index = full_arena()
    handle, _, status = index.open_write(["p"], SLOT_ALIGN)  # evicts a0 for a pending write
    assert status.tolist() == [WriteStatus.GRANTED]
    assert index.hold("p") is None and index.hold("nothing") is None
    index.finish_write(handle, np.zeros(1, dtype=bool))
