"""memcache's answers translated at the boundary, without memcache: batch_alloc's per-key
results and batch_get_key_info's objects."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.errors import StoreError
from kvflow.stores.base import WriteStatus
from kvflow.stores.memcache.client import NO_MEMORY, OBJECT_EXISTS, alloc_results, key_info


def test_alloc_results_per_key() -> None:
    gva = 0x1_0000_0000
    status, gvas, codes = alloc_results([gva, OBJECT_EXISTS, NO_MEMORY[0], 0, -5, (1 << 64) - 7])
    assert status.tolist() == [
        WriteStatus.GRANTED,
        WriteStatus.EXISTS,
        WriteStatus.NO_SPACE,
        WriteStatus.FAILED,  # no reason given
        WriteStatus.FAILED,
        WriteStatus.FAILED,  # -7 through an unsigned type
    ]
    assert gvas.tolist() == [gva, 0, 0, 0, 0, 0]
    assert codes.tolist() == [0, OBJECT_EXISTS, NO_MEMORY[0], 0, -5, -7]


class _Info:
    def __init__(self, size: Any, gvas: Any) -> None:
        self._size, self._gvas = size, gvas

    def size(self) -> Any:
        return self._size

    def gva_list(self) -> Any:
        return self._gvas


def test_key_info_is_a_readable_object_or_none() -> None:
    assert key_info(_Info(4096, [0x2000, 0x9000])) == (0x2000, 4096)
    assert key_info(_Info(0, [0x2000])) is None  # not stored
    assert key_info(_Info(4096, [])) is None
    assert key_info(_Info(4096, [1 << 63])) is None  # a code, not an address


def test_key_info_that_is_no_object_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="batch_get_key_info"):
        key_info(object())
