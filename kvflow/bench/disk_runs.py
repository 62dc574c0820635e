"""The measurements of ``kvflow bench disk``, each on real ``kvflow serve`` pools of its own.

* ``hit_rates``: two traces with real bytes, the eviction bench's prompt mix
  (``kvflow.bench.eviction.prompt_mix``: popular system prompts, growing conversations) and
  returning sessions (``returning_sessions``: agent sessions that come back after many
  others), each replayed through a DRAM pool holding a quarter of its chunks, the same pool
  with a disk tier that holds them all, and a DRAM pool as large as the two tiers together.
  Per pool: the hit rate, the load time of each request's hit (open_read to close_read, every
  byte checked), and how many bytes came back wrong (must be 0).
* ``read_throughput``: objects on disk only, the page cache dropped, read layer by layer
  through a SharedStore, against a plain sequential read of the same files, the page cache
  dropped again; rounds alternate which goes first.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvflow.bench import eviction
from kvflow.bench.stores import pool_server
from kvflow.errors import KVFlowError
from kvflow.keys import KeySpace, chunk_hashes
from kvflow.pool.diskfiles import PAGE, granules
from kvflow.pool.diskread import TAG
from kvflow.pool.store import SharedStore
from kvflow.stores.arena import slot_bytes
from kvflow.stores.base import Direction

__all__ = ["drop_page_cache", "hit_rates", "read_throughput", "tiered_pool"]

_WAIT_S = 300.0  # the disk tier's threads must catch up within this long


def content(key: str, size: int) -> np.ndarray:
    """An object's bytes, from its key (so a read can be checked without keeping them)."""
    pattern = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=64).digest(), np.uint8)
    return np.resize(pattern, size)


def file_bytes(payload: int) -> int:
    """The size of an object's file on disk: its header (a page at least) and payload."""
    header = 24 + 64 + 20 * len(granules(payload)) + 4  # a key of up to 64 bytes
    return -(-header // PAGE) * PAGE + payload


def drop_page_cache(folder: str) -> int:
    """Drop the page cache of every object file under ``folder`` (``POSIX_FADV_DONTNEED``;
    the files were ``fdatasync``ed, so their pages are clean and go); how many files."""
    files = glob.glob(os.path.join(folder, "kvflow-disk-v1", "objects", "*", "*.kvo"))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


@contextmanager
def tiered_pool(
    dram: int, disk: int = 0, reads: str = "layerwise"
) -> Iterator[tuple[SharedStore, str]]:
    """A ``kvflow serve`` of ``dram`` bytes, with a disk tier of ``disk`` bytes in a fresh
    folder on /var/tmp (a disk, not a tmpfs) when ``disk``; a SharedStore on it, and the
    folder ("" without a disk tier)."""
    folder = tempfile.mkdtemp(prefix="kvflow-bench-disk-", dir="/var/tmp") if disk else ""
    options = ("--disk-dir", folder, "--disk-capacity", str(disk), "--disk-reads", reads)
    try:
        with pool_server(dram, *(options if disk else ())) as socket:
            store = SharedStore(socket=socket, populate=True, timeout_s=120.0)
            try:
                yield store, folder
            finally:
                store.close()
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def wait_for(store: SharedStore, done: Callable[[dict[str, int]], bool], what: str) -> None:
    """Poll the server's counters until ``done`` says so (KVFlowError after _WAIT_S)."""
    deadline = time.monotonic() + _WAIT_S
    while not done(stats := store.server_stats()):
        if time.monotonic() > deadline:
            raise KVFlowError(f"the disk tier did not {what} within {_WAIT_S:g} s: {stats}")
        time.sleep(0.02)


def settled(store: SharedStore) -> None:
    """Wait until the disk tier's threads have nothing queued or under way."""
    wait_for(store, lambda s: s["disk_queued"] == 0, "settle")


# -- hit rates ------------------------------------------------------------------------------------


def replay(
    store: SharedStore, trace: Sequence[eviction.Request], size: int, layers: int
) -> dict[str, Any]:
    """Run ``trace`` with real bytes: per request a lookup, the hit loaded layer by layer and
    checked, the rest saved (naming the hit as context). Hit rate, load times, bytes wrong.
    With a disk tier each request waits for the tier's threads before the next (the replay
    runs far faster than an inference server: without it, what DRAM evicts before the writer
    reaches it would measure the replay's pace, not the tier)."""
    tiered = store.server_stats()["disk_capacity"] > 0
    most = max(len(r.keys) for r in trace)
    buf = np.zeros(most * size, dtype=np.uint8)
    store.register([(buf.ctypes.data, buf.nbytes)])
    base = buf.ctypes.data
    stride = size // layers
    hits = asked = wrong = failed = from_disk = 0
    loads: list[float] = []
    for request in trace:
        keys = request.keys
        if not keys:
            continue
        found = store.lookup(keys)
        hit = int(np.argmin(found)) if not found.all() else len(keys)
        hits, asked = hits + hit, asked + len(keys)
        if not request.serve:
            continue
        if hit:
            t0 = time.perf_counter()
            session = store.open_read(keys[:hit])
            ok = session.found.copy()
            from_disk += int((session.addrs >= TAG).sum())
            objs = np.flatnonzero(ok)
            for layer in range(layers):
                pool = session.addrs[objs] + layer * stride
                local = base + objs.astype(np.int64) * size + layer * stride
                bad = store.batch_copy(pool, local, np.full(len(objs), stride), Direction.FROM_POOL)
                ok[objs[bad]] = False
            store.close_read(session)
            loads.append(time.perf_counter() - t0)
            for i in np.flatnonzero(ok):
                if not np.array_equal(buf[i * size : (i + 1) * size], content(keys[i], size)):
                    wrong += size
            failed += int((~ok).sum())
        new = keys[hit:]
        if new:
            writing = store.open_write_with_context(new, size, keys[:hit])
            granted = np.flatnonzero(writing.granted)
            for i in granted:
                buf[i * size : (i + 1) * size] = content(new[i], size)
            local = base + granted.astype(np.int64) * size
            bad = store.batch_copy(
                writing.addrs[granted], local, np.full(len(granted), size), Direction.TO_POOL
            )
            done = writing.granted.copy()
            done[granted[bad]] = False
            store.finish_write(writing, done)
        if tiered:  # requests come at an inference server's pace: the writer keeps up
            settled(store)
    return {
        "hit_rate": hits / asked if asked else 0.0,
        "hits": hits,
        "asked": asked,
        "loads": len(loads),
        "load_ms_mean": 1e3 * statistics.fmean(loads) if loads else 0.0,
        "load_ms_p99": 1e3 * float(np.percentile(loads, 99)) if loads else 0.0,
        "chunks_from_disk": from_disk,
        "failed_chunks": failed,
        "wrong_bytes": wrong,
    }


def returning_sessions(requests: int, sessions: int = 64, seed: int = 0) -> list[eviction.Request]:
    """``requests`` turns of ``sessions`` agent sessions: each request the next turn of a
    session drawn at random (its whole history, then one or two new chunks), a session that
    passes 48 chunks starting over; a session comes back after about ``sessions`` others."""
    rng = np.random.default_rng(seed)
    space = KeySpace(namespace="kvflow-bench-sessions", rank=0)
    per = eviction.TOKENS_PER_CHUNK

    def text(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, 1 << 30, per * int(rng.integers(lo, hi)))

    talks = [text(2, 6) for _ in range(sessions)]
    out = []
    for _ in range(requests):
        i = int(rng.integers(sessions))
        talks[i] = np.concatenate([talks[i], text(1, 3)])
        if len(talks[i]) > 48 * per:
            talks[i] = text(2, 6)
        keys = space.keys(chunk_hashes(talks[i], per))
        out.append(eviction.Request(True, tuple(keys)))
    return out


TRACES: dict[str, Callable[..., list[eviction.Request]]] = {
    "mix": eviction.prompt_mix,
    "sessions": returning_sessions,
}


def hit_rates(requests: int, size: int, layers: int, seed: int = 0) -> dict[str, Any]:
    """Both traces through three pools each (see the module's docstring)."""
    return {name: _hit_rates(make(requests, seed=seed), size, layers)
            for name, make in TRACES.items()}  # fmt: skip


def _hit_rates(trace: list[eviction.Request], size: int, layers: int) -> dict[str, Any]:
    requests = len(trace)
    distinct = len({k for r in trace for k in r.keys})
    dram_chunks = distinct // 4
    slot = slot_bytes(size)
    pools = {
        "dram": (dram_chunks * slot, 0),
        "dram+disk": (dram_chunks * slot, distinct * file_bytes(size)),
        "dram of both sizes": ((dram_chunks + distinct) * slot, 0),
    }
    rows = []
    for name, (dram, disk) in pools.items():
        with tiered_pool(dram, disk) as (store, _):
            row = replay(store, trace, size, layers)
            stats = store.server_stats()
        row.update(pool=name, dram_bytes=dram, disk_bytes=disk)
        row.update({k: stats[k] for k in ("evictions", "demotions", "demotions_skipped")})
        row.update({k: stats[k] for k in ("promotions", "disk_evictions", "disk_io_errors")})
        rows.append(row)
    best = rows[2]["hit_rate"]
    return {
        "requests": requests,
        "distinct_chunks": distinct,
        "object_bytes": size,
        "working_set_over_dram": distinct / dram_chunks,
        "rows": rows,
        "disk_over_big_dram": rows[1]["hit_rate"] / best if best else 0.0,
    }


# -- read throughput -------------------------------------------------------------------------------


def _plain_read(folder: str, chunk: int = 4 << 20) -> int:
    """Read every object file under ``folder`` front to back; the bytes read."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    for path in sorted(glob.glob(os.path.join(folder, "kvflow-disk-v1", "objects", "*", "*.kvo"))):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def _kvflow_read(store: SharedStore, keys: Sequence[str], size: int, layers: int) -> int:
    """Load ``keys`` (all on disk only) layer by layer into local memory; payload bytes."""
    buf = np.empty(len(keys) * size, dtype=np.uint8)
    store.register([(buf.ctypes.data, buf.nbytes)])
    session = store.open_read(keys)
    if not (session.found.all() and (session.addrs >= TAG).all()):
        raise KVFlowError("the objects were not all on disk only")
    stride = size // layers
    local = buf.ctypes.data + np.arange(len(keys), dtype=np.int64) * size
    sizes = np.full(len(keys), stride)
    failed = 0
    for layer in range(layers):
        at = layer * stride
        failed += len(store.batch_copy(session.addrs + at, local + at, sizes, Direction.FROM_POOL))
    store.close_read(session)
    if failed:
        raise KVFlowError(f"{failed} ranges failed")
    for i in (0, len(keys) - 1):
        if not np.array_equal(buf[i * size : (i + 1) * size], content(keys[i], size)):
            raise KVFlowError(f"{keys[i]!r} came back wrong")
    return len(keys) * size


def read_throughput(objects: int, size: int, layers: int, repeats: int) -> dict[str, Any]:
    """GB/s of layerwise reads through kvflow and of a plain sequential read, page cache
    dropped before each; rounds alternate the order, after one round not counted."""
    keys = [f"kvflow-bench-disk/0/{i:08x}" for i in range(objects)]
    slot = slot_bytes(size)
    with tiered_pool(2 * slot, objects * file_bytes(size) + (64 << 20)) as (store, folder):
        src = np.empty(size, dtype=np.uint8)
        store.register([(src.ctypes.data, src.nbytes)])
        for n, key in enumerate(keys, 1):
            src[:] = content(key, size)
            session = store.open_write([key], size)
            store.batch_copy(session.addrs, np.array([src.ctypes.data]), np.array([size]),
                             Direction.TO_POOL)  # fmt: skip
            store.finish_write(session, session.granted)
            wait_for(store, lambda s, n=n: s["demotions"] >= n, "write")  # type: ignore[misc]
        tail = keys[: objects - 2]  # the last two stay in DRAM
        runs: dict[str, list[float]] = {"kvflow": [], "plain": []}
        nbytes = {"kvflow": 0, "plain": 0}
        for r in range(-1, repeats):  # round -1 warms up (the first cold read runs slow)
            order = ("kvflow", "plain") if r % 2 == 0 else ("plain", "kvflow")
            for what in order:
                settled(store)
                os.sync()
                drop_page_cache(folder)
                t0 = time.perf_counter()
                if what == "kvflow":
                    nbytes[what] = _kvflow_read(store, tail, size, layers)
                else:
                    nbytes[what] = _plain_read(folder)
                if r >= 0:
                    runs[what].append(nbytes[what] / (time.perf_counter() - t0) / 1e9)
                if what == "kvflow":  # promoted meanwhile: evict them again
                    settled(store)
                    _evict(store, tail, size)
    kv, plain = statistics.median(runs["kvflow"]), statistics.median(runs["plain"])
    return {
        "objects": objects,
        "object_bytes": size,
        "layers": layers,
        "repeats": repeats,
        "kvflow_gbps": runs["kvflow"],
        "plain_gbps": runs["plain"],
        "kvflow_over_plain": kv / plain,
        "cache": "page cache dropped before each read (POSIX_FADV_DONTNEED on every file)",
    }


def _evict(store: SharedStore, keys: Sequence[str], size: int) -> None:
    """Fill DRAM (two slots) with other objects, so that none of ``keys`` is there."""
    src = np.zeros(size, dtype=np.uint8)
    store.register([(src.ctypes.data, src.nbytes)])
    for i in range(4):
        key = f"kvflow-bench-disk/filler/{i}"
        session = store.open_write([key], size)
        if session.granted[0]:
            store.batch_copy(session.addrs, np.array([src.ctypes.data]), np.array([size]),
                             Direction.TO_POOL)  # fmt: skip
        store.finish_write(session, session.granted)
    settled(store)
