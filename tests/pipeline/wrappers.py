"""Store wrappers for engine tests: they record, fail or stall calls of a real LocalStore.

They wrap the real embedded store (no fake pool): only the chosen calls are changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import kvflow
from kvflow.stores.base import Direction, ReadSession, WriteSession


class WrappedStore(kvflow.Store):
    """Forwards every call to ``inner``, counting metadata calls and recording copies."""

    def __init__(self, inner: kvflow.Store) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.copies: list[tuple[Direction, int]] = []  # (direction, bytes) per batch_copy
        self.lock = threading.Lock()
        self.before_copy: Callable[[Direction, np.ndarray, np.ndarray, np.ndarray], Any] = (
            lambda *a: None
        )

    def _count(self, name: str) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1

    @property
    def metadata_calls(self) -> int:
        return sum(n for k, n in self.calls.items() if k not in ("batch_copy", "register"))

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._count("register")
        self.inner.register(regions)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        self._count("lookup")
        return self.inner.lookup(keys)

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        self._count("open_write")
        return self.inner.open_write(keys, nbytes)

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        self._count("finish_write")
        self.inner.finish_write(session, ok)

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        self._count("open_read")
        return self.inner.open_read(keys)

    def close_read(self, session: ReadSession) -> None:
        self._count("close_read")
        self.inner.close_read(session)

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        self._count("batch_copy")
        override = self.before_copy(direction, pool_addrs, local_addrs, sizes)
        if override is not None:
            return np.asarray(override, dtype=np.int64)
        failed = self.inner.batch_copy(pool_addrs, local_addrs, sizes, direction)
        with self.lock:
            self.copies.append((direction, int(sizes.sum())))
        return failed

    def usage(self) -> kvflow.StoreUsage:
        assert isinstance(self.inner, kvflow.SupportsUsage)
        return self.inner.usage()

    def close(self) -> None:
        self.inner.close()
