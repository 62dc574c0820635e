"""StoreWrapper: a Store that forwards every call to another, abilities included (all but
``prepare_writes``, below).

A store that counts, injects faults, or shares one pool between owners wraps the real store and
changes one or two calls; everything else must reach the inner store unchanged, the optional
abilities too (the prefix-context calls and ``usage``), or the inner store silently loses what
they carry: a wrapped arena that never hears the context evicts a prefix's head before its tail.
Subclass ``StoreWrapper`` and override only what changes. A subclass that changes a plain call
(``open_read``) changes its context form (``open_read_with_context``) too where it matters: the
engine makes the context form whenever a batch names chunks before its own. One that makes
``batch_copy`` wait on anything but memory (a socket, a lock held long, a fault that stalls)
sets ``saves_in_memory`` False: a save's copy may run on the caller's thread. ``prepare_writes``
is the one ability not forwarded (it answers None): prepared copies go to the inner store
straight, and the wrapper's own ``batch_copy`` must run.

Concurrency: whatever the inner store promises (see ``kvflow.stores.base``); the wrapper adds
no state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.stores.base import Direction, ReadSession, Store, StoreUsage, WriteSession

__all__ = ["StoreWrapper"]


class StoreWrapper(Store):
    """Forwards every Store call to ``inner`` but ``prepare_writes``; ``inline_metadata``,
    ``device_memory`` and ``saves_in_memory`` are ``inner``'s."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.inline_metadata = inner.inline_metadata
        self.device_memory = inner.device_memory
        self.saves_in_memory = inner.saves_in_memory

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        self.inner.register(regions)

    def unregister(self, regions: Sequence[tuple[int, int]]) -> None:
        self.inner.unregister(regions)

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        return self.inner.lookup(keys)

    def lookup_with_context(self, keys: Sequence[str], context: Sequence[str]) -> np.ndarray:
        return self.inner.lookup_with_context(keys, context)

    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        return self.inner.open_write(keys, nbytes)

    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession:
        return self.inner.open_write_with_context(keys, nbytes, context)

    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        self.inner.finish_write(session, ok)

    def open_read(self, keys: Sequence[str]) -> ReadSession:
        return self.inner.open_read(keys)

    def open_read_with_context(self, keys: Sequence[str], context: Sequence[str]) -> ReadSession:
        return self.inner.open_read_with_context(keys, context)

    def close_read(self, session: ReadSession) -> None:
        self.inner.close_read(session)

    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        return self.inner.batch_copy(pool_addrs, local_addrs, sizes, direction)

    def usage(self) -> StoreUsage | None:
        return self.inner.usage()

    def contents_epoch(self) -> object:
        return self.inner.contents_epoch()

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
