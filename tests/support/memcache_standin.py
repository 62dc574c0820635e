"""MemcacheStandIn: an in-memory stand-in for memcache's client, ``memcache_hybrid``'s
``DistributedObjectStore``, for machines without Ascend hardware (the real client's ``init``
refuses to start without an NPU driver, so it can store nothing here).

It implements the calls kvflow makes, with the binding's parameter names (checked against the
real 1.3.0 binding by ``test_binding.py`` when it imports) and memcache's documented semantics
(MemFabric Hybrid's ``memcache_api.md``; the answers of a client that is down were observed on
the real binding here):

- The pool is an arena of host memory (a NumPy buffer); GVAs are real addresses into it, so
  ``batch_copy`` really moves bytes (``ctypes.memmove``), by address, with no key in sight.
- ``batch_alloc`` is not idempotent: a key that exists, allocated or readable, is refused. Every
  refusal answers 0, as memcache's does (``alloc_answers`` scripts other answers per key).
- An allocated object is invisible to ``batch_get_key_info(keys, 1)`` (readable objects only)
  and cannot be leased until ``batch_write_finish(keys, [0])``; a non-zero result removes it.
  ``batch_is_exist`` counts allocated objects too (memcache's own users rely on that when two
  writers race; ``exist_counts_allocated=False`` counts readable objects only).
- Read leases: one per key for the process, renewed by every ``batch_add_lease`` and ended by
  one ``batch_remove_lease``; a ttl of 0 means the meta service's default (10 s). An object
  under a live lease is never removed or evicted.
- When an allocation does not fit, the least recently used readable objects without a live
  lease are evicted (memcache evicts in the background between watermarks; here, on demand).
- Error codes are memcache's (<= 0): -3000 invalid parameter, -3007 not found, -3101 state
  mismatch, -3102 unmatched key, -3104 lease not expired, -3019 client not initialised.

Stricter than memcache where that catches a caller's mistake: ``batch_copy`` refuses (-3000,
moving nothing) a range outside every object, a write into an object that is not being written,
and a copy type for the wrong kind of local memory (``local_kind``: host memory takes H2G and
G2H, device memory L2G and G2L).

Every call is recorded in ``calls`` (name, args, kwargs) for order assertions. Faults: the
``*_answers`` dicts script per-key answers, ``copy_answer`` fails every ``batch_copy``,
``broken`` makes the named calls answer as the real binding does when its client is down, and
``stall(name)`` holds a call at the returned gate (``tests.support.gates.Gate``) until it is set.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.support.gates import Gate

__all__ = [
    "Call",
    "KeyInfoStandIn",
    "LocalConfigStandIn",
    "MemcacheStandIn",
    "standin_module",
]

ALIGN = 64  # bytes: objects start on this boundary
DEFAULT_LEASE_TTL_MS = 10_000  # the meta service's ock.mmc.meta.lease_ttl_ms
L2G, G2L, G2H, H2G = 0, 1, 2, 3
INVALID_PARAM = -3000
NOT_FOUND = -3007
CLIENT_NOT_INIT = -3019
STATE_MISMATCH = -3101
UNMATCHED_KEY = -3102
LEASE_NOT_EXPIRED = -3104

# what the real binding answers, per call, when its client is not initialised (observed)
_DOWN: dict[str, Callable[[int], Any]] = {
    "batch_is_exist": lambda n: [CLIENT_NOT_INIT] * n,
    "batch_get_key_info": lambda n: [],
    "batch_alloc": lambda n: [0] * n,
    "batch_copy": lambda n: CLIENT_NOT_INIT,
    "batch_add_lease": lambda n: [INVALID_PARAM] * n,
    "batch_remove_lease": lambda n: CLIENT_NOT_INIT,
    "batch_write_finish": lambda n: [INVALID_PARAM] * n,
    "remove_batch": lambda n: [CLIENT_NOT_INIT] * n,
    "register_buffer": lambda n: CLIENT_NOT_INIT,
    "unregister_buffer": lambda n: CLIENT_NOT_INIT,
}


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class KeyInfoStandIn:
    """memcache's ``KeyInfo``: an object's size and, per replica, its GVA, location and media.
    A key memcache does not report has size 0 and empty lists."""

    def __init__(self, size: int = 0, gva: int = 0, media: int = 1) -> None:
        self._size = size
        self._gvas = [gva] if size else []
        self._types = [media] if size else []

    def size(self) -> int:
        return self._size

    def gva_list(self) -> list[int]:
        return list(self._gvas)

    def loc_list(self) -> list[int]:
        return [0] * len(self._gvas)

    def type_list(self) -> list[int]:
        return list(self._types)

    def __repr__(self) -> str:
        return f"KeyInfoStandIn(size={self._size}, gva_list={self._gvas})"


class LocalConfigStandIn:
    """memcache's ``LocalConfig`` with its defaults: a bag of attributes ``setup`` reads."""

    def __init__(self) -> None:
        self.meta_service_url = "tcp://127.0.0.1:5000"
        self.config_store_url = "tcp://127.0.0.1:6000"
        self.protocol = "host_rdma"
        self.dram_size = "1GB"
        self.hbm_size = "0"
        self.world_size = 256
        self.log_level = "info"
        self.client_timeout_seconds = 60


@dataclass
class _Blob:
    offset: int
    size: int
    media: int
    readable: bool = False
    used: int = 0  # LRU tick


class MemcacheStandIn:
    """An in-memory memcache client over a host arena of ``capacity`` bytes (see the module
    docstring). Thread-safe; copies run in parallel, outside its lock."""

    def __init__(
        self,
        capacity: int = 64 << 20,
        *,
        local_kind: str = "host",
        exist_counts_allocated: bool = True,
    ) -> None:
        assert local_kind in ("host", "device")
        self.capacity = capacity
        self.local_kind = local_kind
        self.exist_counts_allocated = exist_counts_allocated
        self._memory = np.zeros(capacity + ALIGN, dtype=np.uint8)
        raw = int(self._memory.ctypes.data)
        self.base = raw + (-raw % ALIGN)
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        self._blobs: dict[str, _Blob] = {}
        self._leases: dict[str, float] = {}  # key -> when its lease ends (monotonic)
        self._registered: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._ticks = itertools.count(1)
        self._stalls: dict[str, Gate] = {}
        self.alloc_answers: dict[str, int] = {}  # key -> batch_alloc's answer, not allocated
        self.lease_answers: dict[str, int] = {}  # key -> batch_add_lease's answer, no lease
        self.finish_answers: dict[str, int] = {}  # key -> batch_write_finish's answer, no change
        self.copy_answer: int | None = None  # every batch_copy answers this, moving nothing
        self.broken: set[str] = set()  # calls that answer as a client that is down
        self.calls: list[Call] = []
        self.setup_answer = 0
        self.init_answer = 0
        self.evictions = 0
        self.closed = False

    # -- setup --------------------------------------------------------------------------------

    def setup(self, config: Any) -> int:
        self._record("setup", config)
        return self.setup_answer

    def init(self, device_id: int, init_bm: bool = True) -> int:
        self._record("init", device_id, init_bm)
        stall = self._stalls.get("init")
        if stall is not None:
            stall.wait()
        return self.init_answer

    def close(self) -> int:
        self._record("close")
        with self._lock:
            self.closed = True
        return 0

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if (down := self._enter("register_buffer", 1, buffer_ptr, size)) is not None:
            return int(down)
        if buffer_ptr <= 0 or size <= 0:
            return INVALID_PARAM
        with self._lock:
            span = (buffer_ptr, size)
            self._registered[span] = self._registered.get(span, 0) + 1
        return 0

    def unregister_buffer(self, buffer_ptr: int, size: int) -> int:
        if (down := self._enter("unregister_buffer", 1, buffer_ptr, size)) is not None:
            return int(down)
        with self._lock:
            span = (buffer_ptr, size)
            if span not in self._registered:
                return INVALID_PARAM
            self._registered[span] -= 1
            if self._registered[span] == 0:
                del self._registered[span]
        return 0

    # -- metadata -----------------------------------------------------------------------------

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if (down := self._enter("batch_is_exist", len(keys), keys)) is not None:
            return list(down)
        with self._lock:
            return [int(self._visible(k, allocated=self.exist_counts_allocated)) for k in keys]

    def batch_get_key_info(self, keys: Sequence[str], flag: int = 1) -> list[KeyInfoStandIn]:
        if (down := self._enter("batch_get_key_info", len(keys), keys, flag=flag)) is not None:
            return list(down)
        infos = []
        with self._lock:
            for key in keys:
                blob = self._blobs.get(key)
                if blob is None or not self._visible(key, allocated=flag != 1):
                    infos.append(KeyInfoStandIn())
                    continue
                blob.used = next(self._ticks)
                infos.append(KeyInfoStandIn(blob.size, self.base + blob.offset, blob.media))
        return infos

    def batch_alloc(
        self, keys: Sequence[str], sizes: Sequence[int], media: int = 1, leaseTtlMs: int = 0
    ) -> list[int]:
        n = len(keys)
        if (down := self._enter("batch_alloc", n, keys, sizes, media, leaseTtlMs)) is not None:
            return list(down)
        if len(sizes) != n or media not in (0, 1):
            return [0] * n
        gvas = []
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                if key in self.alloc_answers:
                    gvas.append(self.alloc_answers[key])
                elif key in self._blobs or size <= 0:
                    gvas.append(0)  # allocation is not idempotent
                else:
                    offset = self._take(size)
                    if offset is None:
                        gvas.append(0)
                    else:
                        self._blobs[key] = _Blob(offset, size, media, used=next(self._ticks))
                        gvas.append(self.base + offset)
        return gvas

    def batch_write_finish(self, keys: Sequence[str], res: Sequence[int]) -> list[int]:
        n = len(keys)
        if (down := self._enter("batch_write_finish", n, keys, res)) is not None:
            return list(down)
        if len(res) != n:
            return [INVALID_PARAM] * n
        out = []
        with self._lock:
            for key, result in zip(keys, res, strict=True):
                blob = self._blobs.get(key)
                if key in self.finish_answers:
                    out.append(self.finish_answers[key])
                elif blob is None:
                    out.append(UNMATCHED_KEY)
                elif result != 0:
                    out.append(LEASE_NOT_EXPIRED if self._leased(key) else self._drop(key))
                else:
                    blob.readable, blob.used = True, next(self._ticks)
                    out.append(0)
        return out

    def batch_add_lease(self, keys: Sequence[str], leaseTtlMs: int = 0) -> list[int]:
        if (down := self._enter("batch_add_lease", len(keys), keys, leaseTtlMs)) is not None:
            return list(down)
        ttl = (leaseTtlMs or DEFAULT_LEASE_TTL_MS) / 1000
        out = []
        with self._lock:
            now = time.monotonic()
            for key in keys:
                blob = self._blobs.get(key)
                if key in self.lease_answers:
                    out.append(self.lease_answers[key])
                elif blob is None:
                    out.append(NOT_FOUND)
                elif not blob.readable:
                    out.append(STATE_MISMATCH)
                else:
                    self._leases[key] = max(self._leases.get(key, 0.0), now + ttl)
                    blob.used = next(self._ticks)
                    out.append(0)
        return out

    def batch_remove_lease(self, keys: Sequence[str]) -> int:
        if (down := self._enter("batch_remove_lease", len(keys), keys)) is not None:
            return int(down)
        with self._lock:
            missing = [k for k in keys if self._leases.pop(k, None) is None]
        return INVALID_PARAM if missing else 0

    def remove_batch(self, arg0: Sequence[str], /) -> list[int]:
        if (down := self._enter("remove_batch", len(arg0), arg0)) is not None:
            return list(down)
        with self._lock:
            return [
                NOT_FOUND
                if key not in self._blobs
                else LEASE_NOT_EXPIRED
                if self._leased(key)
                else self._drop(key)
                for key in arg0
            ]

    # -- data ---------------------------------------------------------------------------------

    def batch_copy(
        self,
        gva_ptrs: Sequence[int],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        direct: int = 1,
        flag: int = 0,
    ) -> int:
        call = (gva_ptrs, buffer_ptrs, sizes, direct)
        if (down := self._enter("batch_copy", len(gva_ptrs), *call, flag=flag)) is not None:
            return int(down)
        if self.copy_answer is not None:
            return self.copy_answer
        writes = {"host": H2G, "device": L2G}[self.local_kind]
        reads = {"host": G2H, "device": G2L}[self.local_kind]
        if direct not in (writes, reads) or not len(gva_ptrs) == len(buffer_ptrs) == len(sizes):
            return INVALID_PARAM
        with self._lock:
            if not self._inside_objects(gva_ptrs, sizes, writing=direct == writes):
                return INVALID_PARAM
        for gva, ptr, size in zip(gva_ptrs, buffer_ptrs, sizes, strict=True):
            dst, src = (gva, ptr) if direct == writes else (ptr, gva)
            ctypes.memmove(dst, src, size)
        return 0

    # -- for tests ----------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The names of the calls made so far, in order."""
        with self._lock:
            return [c.name for c in self.calls]

    def objects(self) -> dict[str, str]:
        """Every object: key -> ``allocated`` or ``readable``."""
        with self._lock:
            return {k: "readable" if b.readable else "allocated" for k, b in self._blobs.items()}

    def leased(self) -> set[str]:
        """Keys under a live read lease."""
        with self._lock:
            return {k for k in self._leases if self._leased(k)}

    def registered(self) -> list[tuple[int, int]]:
        with self._lock:
            return sorted(self._registered)

    def read(self, key: str) -> bytes:
        """An object's bytes, straight from the arena."""
        with self._lock:
            blob = self._blobs[key]
            start = self.base - int(self._memory.ctypes.data) + blob.offset
            return self._memory[start : start + blob.size].tobytes()

    def stall(self, name: str) -> Gate:
        """Calls to ``name`` wait at the returned gate until it is set (at most its 60 s);
        ``gate.held`` tells whether one is still held there."""
        gate = Gate()
        self._stalls[name] = gate
        return gate

    # -- internals ----------------------------------------------------------------------------

    def _enter(self, name: str, n: int, *args: Any, **kwargs: Any) -> Any:
        """Record the call; a broken call (or any call after close) answers as the real binding's
        down client does: returns that answer, else None."""
        self._record(name, *args, **kwargs)
        stall = self._stalls.get(name)
        if stall is not None:
            stall.wait()
        if name in self.broken or self.closed:
            return _DOWN[name](n)
        return None

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        frozen = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in args)
        with self._lock:
            self.calls.append(Call(name, frozen, dict(kwargs)))

    def _visible(self, key: str, *, allocated: bool) -> bool:
        blob = self._blobs.get(key)
        return blob is not None and (blob.readable or allocated)

    def _leased(self, key: str) -> bool:
        return self._leases.get(key, 0.0) > time.monotonic()

    def _inside_objects(self, gvas: Sequence[int], sizes: Sequence[int], *, writing: bool) -> bool:
        spans = sorted((self.base + b.offset, b.size, b.readable) for b in self._blobs.values())
        starts = [s[0] for s in spans]
        for gva, size in zip(gvas, sizes, strict=True):
            i = bisect.bisect_right(starts, gva) - 1
            if i < 0 or size < 0 or gva + size > spans[i][0] + spans[i][1]:
                return False
            if writing and spans[i][2]:
                return False
        return True

    def _take(self, size: int) -> int | None:
        """An aligned offset for ``size`` bytes, evicting LRU readable, unleased objects."""
        need = size + (-size % ALIGN)
        while True:
            for i, (offset, room) in enumerate(self._free):
                if room >= need:
                    rest = (offset + need, room - need)
                    self._free[i : i + 1] = [rest] if rest[1] else []
                    return offset
            victims = [k for k, b in self._blobs.items() if b.readable and not self._leased(k)]
            if not victims:
                return None
            self._drop(min(victims, key=lambda k: self._blobs[k].used))
            self.evictions += 1

    def _drop(self, key: str) -> int:
        """Remove an object and give its space back; answers 0."""
        blob = self._blobs.pop(key)
        self._leases.pop(key, None)
        need = blob.size + (-blob.size % ALIGN)
        bisect.insort(self._free, (blob.offset, need))
        merged: list[tuple[int, int]] = []
        for offset, room in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + room)
            else:
                merged.append((offset, room))
        self._free = merged
        return 0


def standin_module(client: Callable[[], Any]) -> types.ModuleType:
    """A stand-in for the ``memcache_hybrid`` module whose ``DistributedObjectStore()`` is
    ``client()``: put it in ``sys.modules`` to drive MemcacheStore's own setup path."""
    module = types.ModuleType("memcache_hybrid")
    names = {"DistributedObjectStore": client, "LocalConfig": LocalConfigStandIn}
    names.update(KeyInfo=KeyInfoStandIn, L2G=L2G, G2L=G2L, G2H=G2H, H2G=H2G)
    for name, value in names.items():
        setattr(module, name, value)
    return module
