"""The store interface every pool engine implements, and the sessions it hands out.

A transfer touches the store's metadata twice per request batch, whatever the layer count:

    lookup(keys)                         which keys are stored (committed)
    open_write(keys, nbytes) -> WriteSession   reserve objects; per-key base addresses
    open_read(keys) -> ReadSession       lease objects; per-key base addresses
    batch_copy(pool, local, sizes, dir)  move bytes by address; no metadata (called per layer)
    finish_write(session, ok)            commit the objects whose every layer was written; abort
                                         the others (their space comes back)
    close_read(session)                  release the leases

Contract, for every store:

* A written object is invisible to ``lookup`` and ``open_read`` until ``finish_write`` commits it;
  an aborted or never-finished write is never visible.
* A leased object is never evicted or overwritten until ``close_read``.
* ``open_write`` never hands out space that another object, pending or committed, uses.
* Every session is finished or closed exactly once; a second call raises InvalidArgumentError.
* ``batch_copy`` copies ``sizes[i]`` bytes between ``pool_addrs[i]`` and ``local_addrs[i]`` and
  returns the indices of the ranges that failed (an empty array when all succeeded). It raises
  ``StoreError`` only when it could not try at all; the caller then fails every range.
* Metadata calls are thread-safe; ``batch_copy`` may run on several threads at once.
* Calls may block (locks, sockets): async callers run them off the event loop.

Optional abilities are methods with a default in ``Store``, so that every store, and every store
that forwards to another (``StoreWrapper``), answers them:

* ``lookup_with_context``, ``open_write_with_context``, ``open_read_with_context``: the calls
  that also name the chunks before their keys (the *prefix context*, below). By default each is
  its plain call; a store that orders eviction by prefix overrides them.
* ``usage()``: occupancy and counters, or None (the default) for a store that keeps none.
* ``contents_epoch()``: a value that changes when the pool may have lost everything at once (a
  restarted server), or None (the default): not known.
* ``prepare_writes(layers)``: a save's per-layer copies with their arguments checked once, when
  it opens (``PreparedWrites``), or None (the default): the caller calls ``batch_copy``. The one
  ability ``StoreWrapper`` does not forward: a wrapper's own ``batch_copy`` must run.

(They were once protocols checked with ``isinstance``; a forwarding store cannot know statically
what the store it wraps can do, and a check on the wrapper silently dropped the context.)

Prefix context. Chunk keys are prefix-chained: a chunk is of use only while every chunk before it
is stored. A caller that moves only part of a prompt (a save of its new chunks, a load after the
chunks an inference server's own cache holds) names the chunks before them as ``context``: the
keys of those chunks, in prefix order (for a batch, each request's in turn). Context keys are
never granted, written, leased or counted as hits or misses, and cost no copy; a store that
evicts a prefix's tail before its head only touches the ones it holds (committed and unleased;
others are left alone) for its eviction order, after the call's own keys and last to first, so
that a prompt's head ends up more recently used than its tail:

* ``lookup_with_context``: when it looks up;
* ``open_write_with_context``: when it opens (an allocation then never evicts a context key for
  the call's own) and again when ``finish_write`` commits;
* ``open_read_with_context``: when it opens and again when ``close_read`` releases.

Otherwise each call is its plain counterpart, with the same results and contract. Stores that
evict by a policy of their own (Mooncake, memcache) keep the defaults. Callers with no context
make the plain calls.
"""

from __future__ import annotations

import enum
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "Direction",
    "PreparedWrites",
    "ReadSession",
    "Store",
    "StoreUsage",
    "WriteSession",
    "WriteStatus",
]


class Direction(enum.IntEnum):
    """Which way ``batch_copy`` moves bytes."""

    TO_POOL = 0
    FROM_POOL = 1


class WriteStatus(enum.IntEnum):
    """What ``open_write`` did for one key."""

    GRANTED = 0  # space reserved: write every layer, then finish
    EXISTS = 1  # already stored, or being written by another session: nothing to do
    NO_SPACE = 2  # no room even after eviction: the save of this chunk is skipped
    FAILED = 3  # the store refused or failed for this key


@dataclass(frozen=True, eq=False)
class WriteSession:
    """Space reserved by ``open_write``. ``addrs[i]`` is valid where ``status[i] == GRANTED``."""

    handle: int
    keys: tuple[str, ...]
    addrs: np.ndarray
    status: np.ndarray

    @property
    def granted(self) -> np.ndarray:
        granted: np.ndarray = self.status == WriteStatus.GRANTED
        return granted


@dataclass(frozen=True, eq=False)
class ReadSession:
    """Leases taken by ``open_read``. ``addrs[i]`` is valid where ``found[i]``."""

    handle: int
    keys: tuple[str, ...]
    addrs: np.ndarray
    found: np.ndarray


@dataclass(frozen=True)
class StoreUsage:
    """A snapshot of a pool's occupancy and counters."""

    capacity: int
    used: int
    objects: int
    pending_writes: int
    leases: int
    open_sessions: int
    hits: int
    misses: int
    evictions: int
    no_space: int


class PreparedWrites(Protocol):
    """A save's copies, checked once for all its layers (``Store.prepare_writes``). ``copy``
    is thread-safe and takes the layers in any order, each as often as a caller asks; once
    the session is finished its ranges fail (the slots are gone), and after the store's
    ``close`` it raises ClosedError."""

    def copy(self, layer: int) -> np.ndarray:
        """``batch_copy`` of layer ``layer``'s ranges to the pool: the indices that failed."""
        ...


class Store(ABC):
    """A KV pool. See the module docstring for the contract every method keeps.

    ``inline_metadata`` is True for stores whose metadata calls are in-process and take
    microseconds (never a socket or a remote call): the engine then calls them on its event loop
    instead of hopping to its metadata thread, which costs more than the call itself.

    ``device_memory`` names the kinds of memory (torch device types) that ``batch_copy``'s local
    addresses may point into: host memory (``"cpu"``) for stores that copy with the CPU; a
    store whose own copy engine reaches accelerator memory (memcache's ``L2G``/``G2L`` on an
    NPU) names that device. The host pools name ``"cuda"`` too: on a CUDA GPU their
    ``copy_ranges`` call goes to the copy thread's mover (``kvflow.devices.CudaDevice``), so
    such a store copies through ``copy_ranges`` once per ``batch_copy``. The engine refuses KV
    caches on a device its store cannot copy.

    ``saves_in_memory`` is True for stores whose ``batch_copy`` to the pool is a memmove into
    pool memory mapped in this process: it waits on no socket, disk or other process, so it
    takes as long as the bytes do and can run on the caller's thread (the sync engine's
    ``inline_saves``).
    """

    inline_metadata: bool = False
    device_memory: frozenset[str] = frozenset({"cpu"})  # see the class docstring
    saves_in_memory: bool = False

    @abstractmethod
    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Declare local memory ``(address, nbytes)`` that ``batch_copy`` may touch. Idempotent."""

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        """A bool array: which keys are committed. Touches found keys for LRU."""

    @abstractmethod
    def open_write(self, keys: Sequence[str], nbytes: int) -> WriteSession:
        """Reserve ``nbytes`` for each key not already stored; evicts LRU objects if full."""

    @abstractmethod
    def finish_write(self, session: WriteSession, ok: np.ndarray) -> None:
        """Commit granted keys where ``ok[i]``; abort the other granted keys."""

    @abstractmethod
    def open_read(self, keys: Sequence[str]) -> ReadSession:
        """Lease every committed key; missing keys come back with ``found[i] == False``."""

    @abstractmethod
    def close_read(self, session: ReadSession) -> None:
        """Release the session's leases."""

    @abstractmethod
    def batch_copy(
        self,
        pool_addrs: np.ndarray,
        local_addrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
    ) -> np.ndarray:
        """Move bytes; returns the indices of failed ranges (empty when all succeeded)."""

    def unregister(self, regions: Sequence[tuple[int, int]]) -> None:  # noqa: B027 - optional
        """Undo one ``register`` of the same regions (the memory is about to be freed). Stores
        that pin or register memory with a transport count registrations and release a region
        when its last user unregisters it; the others need not do anything."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the store's resources. Sessions still open are aborted or released."""

    # -- optional abilities: defaults every store answers (module docstring) -------------------

    def lookup_with_context(self, keys: Sequence[str], context: Sequence[str]) -> np.ndarray:
        """``lookup``, with ``context`` the chunks before ``keys`` (prefix context)."""
        return self.lookup(keys)

    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession:
        """``open_write``, with ``context`` the chunks before ``keys`` (prefix context)."""
        return self.open_write(keys, nbytes)

    def open_read_with_context(self, keys: Sequence[str], context: Sequence[str]) -> ReadSession:
        """``open_read``, with ``context`` the chunks before ``keys`` (prefix context)."""
        return self.open_read(keys)

    def prepare_writes(
        self, layers: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]
    ) -> PreparedWrites | None:
        """A save's ``batch_copy`` calls to the pool, one per layer (``(pool_addrs,
        local_addrs, sizes)`` each), their arguments checked now, once, instead of at every
        call (bad input raises here, as ``batch_copy`` would); None (this default): not
        offered, the caller calls ``batch_copy``. The result's ``copy(i)`` fails the ranges
        whose write slots are gone by then, as ``batch_copy`` does. The engine calls it on its
        event loop when a save opens: it must not block (no I/O). A wrapper does not forward
        it (``StoreWrapper``): the wrapper's own ``batch_copy`` must run."""
        return None

    def usage(self) -> StoreUsage | None:
        """The pool's occupancy and counters, or None (this default) for a store that keeps
        none. May be a round trip (SharedStore asks its server) and then raises
        StoreUnavailableError when the pool cannot be reached."""
        return None

    def contents_epoch(self) -> object:
        """A value that changes when the pool may have lost everything it held at once (its
        server restarted), as far as this client has seen; None (this default): not known.
        Never a round trip. Callers that remember which keys the pool holds forget them when
        it changes."""
        return None


# -- the ability protocols of earlier releases, kept one release ---------------------------------


@runtime_checkable
class _SupportsUsage(Protocol):
    def usage(self) -> StoreUsage | None: ...


@runtime_checkable
class _SupportsPrefixContext(Protocol):
    def lookup_with_context(self, keys: Sequence[str], context: Sequence[str]) -> np.ndarray: ...

    def open_write_with_context(
        self, keys: Sequence[str], nbytes: int, context: Sequence[str]
    ) -> WriteSession: ...

    def open_read_with_context(
        self, keys: Sequence[str], context: Sequence[str]
    ) -> ReadSession: ...


_DEPRECATED: dict[str, type] = {
    "SupportsUsage": _SupportsUsage,
    "SupportsPrefixContext": _SupportsPrefixContext,
}


def deprecated_name(module: str, name: str) -> type:
    """``module.name`` for a name of an earlier release, with a DeprecationWarning saying what
    replaced it; AttributeError for any other name (a module's ``__getattr__``)."""
    if name not in _DEPRECATED:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} is deprecated: every Store answers the ability's calls now (their "
        "defaults are in kvflow.abc.Store), so an isinstance check is always true; call them "
        "(usage() returns None for a store that keeps no counts)",
        DeprecationWarning,
        stacklevel=3,
    )
    return _DEPRECATED[name]


def __getattr__(name: str) -> type:
    return deprecated_name(__name__, name)
