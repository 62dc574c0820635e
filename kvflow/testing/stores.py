"""InstrumentedStore: any store with its calls counted and its copies timed (tests, benchmarks).

``InstrumentedStore(inner)`` is a ``StoreWrapper``: it forwards every call to ``inner`` and
counts it (``calls``, ``keys``, ``metadata_calls``: the ``METADATA_CALLS`` among them; a call
with prefix context counts as its plain call), and with ``record_copies`` keeps one
``CopyRecord`` per ``batch_copy``. Subclass it to inject faults: override one call (and its
context form where the engine may make it), do the damage, and forward the rest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.stores.base import Direction, ReadSession, Store, WriteSession
from kvflow.stores.wrapper import StoreWrapper

__all__ = ["METADATA_CALLS", "CopyRecord", "InstrumentedStore"]

METADATA_CALLS = ("lookup", "open_write", "finish_write", "open_read", "close_read")


@dataclass(frozen=True)
class CopyRecord:
    """One ``batch_copy``: when it ran (``time.perf_counter``), which way, what it carried."""

    start: float
    end: float
    direction: Direction
    ranges: int
    nbytes: int


class InstrumentedStore(StoreWrapper):
    """Forwards every call to ``inner`` and counts it: ``calls[name]``, ``keys[name]`` (keys
    carried), and with ``record_copies`` one CopyRecord per ``batch_copy``. Thread-safe; the
    counting costs a lock per call and nothing per range."""

    def __init__(self, inner: Store, *, record_copies: bool = False) -> None:
        super().__init__(inner)
        self.record_copies = record_copies
        self.calls: dict[str, int] = {}
        self.keys: dict[str, int] = {}
        self.copies: list[CopyRecord] = []
        self._lock = threading.Lock()

    def _count(self, name: str, keys: int = 0) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.keys[name] = self.keys.get(name, 0) + keys

    @property
    def metadata_calls(self) -> int:
        """Calls that touch the store's index (everything but copies and registration)."""
        return sum(self.calls.get(name, 0) for name in METADATA_CALLS)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.keys.clear()
            self.copies.clear()

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self._count("register")
        self.inner.register(regions)

    def unregister(self, regions: Sequence[tuple[int, int]]) -> None:
        self._count("unregister")
        self.inner.unregister(regions)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        self._count("lookup", len(keys))
        return self.inner.lookup(keys)

    def lookup_with_context(self, keys: Sequence[str], context: Sequence[str]) -> np.ndarray:
        self._count("lookup", len(keys))
        return self.inner.lookup_with_context(keys, context)

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        self._count("open_write", len(keys))
        return self.inner.open_write(keys, nbytes)

    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession:
        self._count("open_write", len(keys))
        return self.inner.open_write_with_context(keys, nbytes, context)

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        self._count("finish_write", len(session.keys))
        self.inner.finish_write(session, ok)

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        self._count("open_read", len(keys))
        return self.inner.open_read(keys)

    def open_read_with_context(self, keys: Sequence[str], context: Sequence[str]) -> ReadSession:
        self._count("open_read", len(keys))
        return self.inner.open_read_with_context(keys, context)

    def close_read(self, session: ReadSession) -> None:
        self._count("close_read", len(session.keys))
        self.inner.close_read(session)

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        self._count("batch_copy")
        start = time.perf_counter()
        failed = self.inner.batch_copy(pool_addrs, local_addrs, sizes, direction)
        if self.record_copies:
            record = CopyRecord(
                start, time.perf_counter(), direction, int(sizes.shape[0]), int(sizes.sum())
            )
            with self._lock:
                self.copies.append(record)
        return failed

    def __repr__(self) -> str:
        return f"InstrumentedStore({self.inner!r}, calls={self.calls})"
