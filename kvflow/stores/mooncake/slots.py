"""Virtual pool addresses for Mooncake's objects, and the open sessions' slots (no client and
no lock of their own: planning only).

Mooncake addresses objects by key and offset, not by address, so MooncakeStore hands out
*virtual* pool addresses: each object of an open session gets a slot, and
``VIRTUAL_TAG | slot << SLOT_SHIFT | offset`` addresses byte ``offset`` of it. ``VIRTUAL_TAG``
is bit 62, which no host address has, so a host address passed as a pool address is refused
as bad input; ``decode`` turns a layer's addresses back into (slot, offset) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvflow.errors import InvalidArgumentError, StoreError

__all__ = [
    "MAX_OBJECT_BYTES",
    "VIRTUAL_TAG",
    "Session",
    "SlotTable",
    "address",
    "decode",
    "plan_copy",
]

SLOT_SHIFT = 40  # objects up to 1 TiB
VIRTUAL_TAG = 1 << 62
MAX_OBJECT_BYTES = (1 << SLOT_SHIFT) - 1  # the offset mask
MAX_SLOTS = (1 << 22) - 1  # slot bits 40..61; the all-ones slot is never handed out


def address(slot: int) -> int:
    """The virtual pool address of byte 0 of the object in ``slot``."""
    return VIRTUAL_TAG | slot << SLOT_SHIFT


def decode(pool_addrs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per range, its slot and offset; InvalidArgumentError for an address no store hands out
    (untagged, negative, the spare slot, or a range running past the largest object)."""
    slots = (pool_addrs & ~VIRTUAL_TAG) >> SLOT_SHIFT
    offsets = pool_addrs & MAX_OBJECT_BYTES
    bad = ((pool_addrs & VIRTUAL_TAG) == 0) | (pool_addrs < 0) | (slots >= MAX_SLOTS)
    bad |= sizes > MAX_OBJECT_BYTES + 1 - offsets  # past the largest object: wraps
    if bad.any():
        shown = hex(int(pool_addrs[bad][0]))
        raise InvalidArgumentError("pool_addrs", shown, "not an address this store handed out")
    return slots, offsets


@dataclass(eq=False)
class Session:
    """An open session of a MooncakeStore."""

    keys: tuple[str, ...]
    slots: dict[int, int]  # position in keys -> slot, for the objects copied through
    writing: bool
    nbytes: int = 0
    pending: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # legacy.stage

    @property
    def objects(self) -> int:
        return len(self.slots)


class SlotTable:
    """The slots of the objects of open sessions: slot -> (key, writing), and for objects of
    read sessions that lie in this process's own segment, where (address, size) and until
    when they may be read there. A freed slot is handed out again. Not thread-safe: the
    store's lock guards it."""

    def __init__(self) -> None:
        self._owners: dict[int, tuple[str, bool]] = {}
        self._local: dict[int, tuple[int, int, float]] = {}
        self._free: list[int] = []
        self._next = 0

    def take(self, key: str, writing: bool) -> int:
        if self._free:
            slot = self._free.pop()
        elif self._next < MAX_SLOTS:
            slot, self._next = self._next, self._next + 1
        else:
            raise StoreError(f"more than {MAX_SLOTS} objects open at once")
        self._owners[slot] = (key, writing)
        return slot

    def place(self, slot: int, where: tuple[int, int], until: float) -> None:
        """The object in ``slot`` lies at ``where`` in the own segment, readable there until
        ``until`` (monotonic)."""
        self._local[slot] = (*where, until)

    def release(self, slot: int) -> None:
        del self._owners[slot]
        self._local.pop(slot, None)
        self._free.append(slot)

    def clear(self) -> None:
        self._owners.clear()
        self._local.clear()

    def resolve(
        self, slots: list[int], writing: bool, now: float
    ) -> tuple[dict[int, str], dict[int, tuple[int, int]]]:
        """Of ``slots``, those of open sessions of this direction (slot -> key), and of those
        the ones to read from the own segment now (slot -> address, size)."""
        held: dict[int, str] = {}
        local: dict[int, tuple[int, int]] = {}
        for slot in slots:
            owner = self._owners.get(slot)
            if owner is None or owner[1] != writing:
                continue
            held[slot] = owner[0]
            where = None if writing else self._local.get(slot)
            if where is not None and now < where[2]:
                local[slot] = where[:2]
        return held, local


def plan_copy(
    slots: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    held: dict[int, str],
    local: dict[int, tuple[int, int]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """A layer's ranges sorted out (``resolve``'s answer for their slots): which fail (their
    slot is not held), which are read straight from the own segment (their indexes, and the
    address each starts at there), and the rest grouped by slot, in slot order, for one
    ranged call."""
    unique, inverse = np.unique(slots, return_inverse=True)
    base = np.zeros(unique.size, dtype=np.int64)  # per slot: address in the own segment
    room = np.zeros(unique.size, dtype=np.int64)  # and the object's size there
    for i, slot in enumerate(unique.tolist()):
        base[i], room[i] = local.get(slot, (0, 0))
    known = np.array([slot in held for slot in unique.tolist()], dtype=bool)
    failed = ~known[inverse]
    direct = np.flatnonzero((base[inverse] != 0) & (sizes <= room[inverse] - offsets))
    sources = base[inverse[direct]] + offsets[direct]
    rest = np.flatnonzero(~failed)
    rest = rest[~np.isin(rest, direct)]
    order = rest[np.argsort(slots[rest], kind="stable")]
    groups = np.split(order, np.flatnonzero(np.diff(slots[order])) + 1) if order.size else []
    return failed, direct, sources, groups
