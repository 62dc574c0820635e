"""Thread-safety: many threads writing and reading overlapping keys through one small store.

Every key's bytes are a fixed function of the key (``content``), so any read that finds a key
must see exactly those bytes: a torn read, a read of a pending or aborted object, or a slot handed
to two objects at once shows up as a mismatch. An arena store holds far fewer objects than there
are keys, so eviction runs constantly; Mooncake's segment holds them all (sessions and leases race
instead).
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvflow.abc import Direction, Store, WriteStatus
from tests.support.objects import OBJ_BYTES, addr, alloc_registered, assert_usage, content
from tests.support.pools import make_store

THREADS = 8
CYCLES = 500  # per thread
KEYS = [f"key-{i}" for i in range(48)]
SLOTS = 12  # objects an arena store holds
MAX_BATCH = 4
HALF = OBJ_BYTES // 2  # objects are written in two batch_copy calls, like two layers
CONTENT = {key: content(key) for key in KEYS}
SWITCH_INTERVAL_S = 1e-5
GARBAGE = np.full(OBJ_BYTES, 0xEE, dtype=np.uint8)  # written into slots that get aborted


@dataclass
class Tally:
    writes_committed: int = 0
    writes_aborted: int = 0
    reads_found: int = 0
    reads_missed: int = 0


def _worker(store: Store, seed: int) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    src = alloc_registered(store, MAX_BATCH * OBJ_BYTES)  # registered from this thread
    dst = alloc_registered(store, MAX_BATCH * OBJ_BYTES)
    for _ in range(CYCLES):
        keys = rng.sample(KEYS, rng.randint(1, MAX_BATCH))
        if rng.random() < 0.5:
            session = store.open_write(keys, OBJ_BYTES)
            granted = np.flatnonzero(session.status == WriteStatus.GRANTED)
            ok = np.array([rng.random() < 0.8 for _ in keys])
            for j, i in enumerate(granted):
                body = CONTENT[keys[i]] if ok[i] else GARBAGE
                src[j * OBJ_BYTES : (j + 1) * OBJ_BYTES] = body
            for start in (0, HALF):
                failed = store.batch_copy(
                    session.addrs[granted] + start,
                    np.array(
                        [addr(src) + j * OBJ_BYTES + start for j in range(granted.size)],
                        dtype=np.int64,
                    ),
                    np.full(granted.size, HALF, dtype=np.int64),
                    Direction.TO_POOL,
                )
                assert failed.size == 0
            store.finish_write(session, ok)
            tally.writes_committed += int(ok[granted].sum())
            tally.writes_aborted += int((~ok[granted]).sum())
        else:
            if rng.random() < 0.3:
                store.lookup(keys)  # touches LRU order concurrently
            session = store.open_read(keys)
            found = np.flatnonzero(session.found)
            dst[:] = 0
            failed = store.batch_copy(
                session.addrs[found],
                np.array([addr(dst) + j * OBJ_BYTES for j in range(found.size)], dtype=np.int64),
                np.full(found.size, OBJ_BYTES, dtype=np.int64),
                Direction.FROM_POOL,
            )
            assert failed.size == 0
            for j, i in enumerate(found):
                got = dst[j * OBJ_BYTES : (j + 1) * OBJ_BYTES]
                if not np.array_equal(got, CONTENT[keys[i]]):
                    raise AssertionError(f"read of {keys[i]} saw the wrong bytes")
            store.close_read(session)
            tally.reads_found += int(found.size)
            tally.reads_missed += len(keys) - int(found.size)
    return tally


def test_concurrent_writes_and_reads_never_see_wrong_bytes(store_name: str) -> None:
    store = make_store(store_name, SLOTS * OBJ_BYTES)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # switch threads often: races show up sooner
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            futures = [pool.submit(_worker, store, seed) for seed in range(THREADS)]
            tallies = [f.result() for f in futures]
        sys.setswitchinterval(interval)

        assert_usage(store, leases=0, pending_writes=0, open_sessions=0)
        # an arena filled up and evicted (the test exercised eviction) and never overflowed
        assert_usage(store, objects=range(1, SLOTS + 1), evictions=range(1, sys.maxsize))
        assert sum(t.reads_found for t in tallies) > 0
        assert sum(t.reads_missed for t in tallies) > 0
        assert sum(t.writes_aborted for t in tallies) > 0

        # what survived is intact, and exactly the stored keys take space
        found = store.lookup(KEYS)
        stored = int(found.sum())
        assert stored > 0
        assert_usage(store, objects=stored, used=stored * OBJ_BYTES)
        dst = alloc_registered(store, len(KEYS) * OBJ_BYTES)
        session = store.open_read(KEYS)
        hits = np.flatnonzero(session.found)
        store.batch_copy(
            session.addrs[hits],
            np.array([addr(dst) + int(i) * OBJ_BYTES for i in hits], dtype=np.int64),
            np.full(hits.size, OBJ_BYTES, dtype=np.int64),
            Direction.FROM_POOL,
        )
        store.close_read(session)
        for i in hits:
            got = dst[i * OBJ_BYTES : (i + 1) * OBJ_BYTES]
            np.testing.assert_array_equal(got, CONTENT[KEYS[i]], err_msg=KEYS[i])
    finally:
        sys.setswitchinterval(interval)
        store.close()
