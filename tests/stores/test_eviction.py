"""Eviction keeps prefixes reachable: chunk keys are prefix-chained, so a stored chunk is of use
only while every chunk before it is stored too. Run against every arena store (LocalStore and
the ``kvflow serve`` pool through SharedStore)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import kvflow
from kvflow.abc import Store, WriteStatus
from kvflow.keys import KeySpace, chunk_hashes
from kvflow.stores.arena import slot_bytes
from tests.support.caches import make_caches
from tests.support.objects import OBJ_BYTES, SMALL_OBJECTS, content, usage, write_objects
from tests.support.pools import dispose, make_store

GRANTED = WriteStatus.GRANTED
EXISTS = WriteStatus.EXISTS
NO_SPACE = WriteStatus.NO_SPACE


def save(store: Store, *keys: str) -> list[int]:
    """Write and commit ``keys`` in one call, as the engine saves a prompt's chunks."""
    status: list[int] = write_objects(store, {k: content(k) for k in keys}).tolist()
    return status


def evicted_by(store: Store, candidates: list[str], *new: str) -> list[str]:
    """Commit ``new`` into the full pool in one call; the ``candidates`` it pushed out."""
    before = usage(store).evictions
    assert save(store, *new) == [GRANTED] * len(new)
    assert usage(store).evictions == before + len(new)
    found = store.lookup(candidates).tolist()  # (this touches what it finds)
    return [key for key, f in zip(candidates, found, strict=True) if not f]


# -- the order one call leaves behind -----------------------------------------------------------


@pytest.mark.arena("watches the eviction order")
def test_a_saved_prefix_is_evicted_tail_first(small_store: Store) -> None:
    keys = [f"a{i}" for i in range(SMALL_OBJECTS)]
    assert save(small_store, *keys) == [GRANTED] * SMALL_OBJECTS
    assert evicted_by(small_store, keys, "x") == ["a3"]


@pytest.mark.arena("watches the eviction order")
def test_a_lookup_touches_a_prefix_tail_first(small_store: Store) -> None:
    keys = [f"a{i}" for i in range(SMALL_OBJECTS)]
    for key in reversed(keys):  # committed head last: a0 the most recently used
        save(small_store, key)
    assert small_store.lookup(keys).all()  # now the head is again more recent than the tail
    assert evicted_by(small_store, keys, "x") == ["a3"]


@pytest.mark.arena("watches the eviction order")
def test_a_load_gives_its_leases_back_tail_first(small_store: Store) -> None:
    keys = [f"a{i}" for i in range(SMALL_OBJECTS)]
    for key in reversed(keys):
        save(small_store, key)
    session = small_store.open_read(keys)
    assert session.found.all()
    small_store.close_read(session)
    assert evicted_by(small_store, keys, "x") == ["a3"]


@pytest.mark.arena("watches the eviction order")
def test_extending_a_prefix_leaves_its_head_the_most_recent(small_store: Store) -> None:
    """The chunks that existed are touched again at the commit, after the new tail."""
    assert save(small_store, "a0", "a1") == [GRANTED, GRANTED]
    assert save(small_store, "a0", "a1", "a2", "a3") == [EXISTS, EXISTS, GRANTED, GRANTED]
    assert evicted_by(small_store, ["a0", "a1", "a2", "a3"], "x", "y") == ["a2", "a3"]


@pytest.mark.arena("fills the pool with one call's own prefix")
def test_a_save_never_evicts_its_own_prefix_for_its_tail(small_store: Store) -> None:
    assert save(small_store, "a0", "a1", "a2") == [GRANTED] * 3
    status = save(small_store, "a0", "a1", "a2", "a3", "a4")  # room for a3 only
    assert status == [EXISTS, EXISTS, EXISTS, GRANTED, NO_SPACE]
    assert small_store.lookup(["a0", "a1", "a2", "a3", "a4"]).tolist() == [True] * 4 + [False]


@pytest.mark.arena("watches the eviction order")
def test_a_leased_head_outlives_its_tail(small_store: Store) -> None:
    keys = [f"a{i}" for i in range(SMALL_OBJECTS)]
    save(small_store, *keys)
    held = small_store.open_read(keys[:2])  # a shorter prompt's load holds a0, a1
    assert evicted_by(small_store, keys, "x", "y") == ["a2", "a3"]
    assert save(small_store, "z") == [GRANTED]  # evicts x or y, never a leased chunk
    small_store.close_read(held)
    assert small_store.lookup(keys[:2]).all()


# -- context: the chunks before the ones a call moves ---------------------------------------------


def save_after(store: Store, context: list[str], *keys: str) -> list[int]:
    """Write and commit ``keys`` in one call naming ``context`` as the chunks before them (the
    bytes are not copied: the order is what these tests watch)."""
    session = store.open_write_with_context(keys, OBJ_BYTES, context)
    store.finish_write(session, np.ones(len(keys), dtype=bool))
    status: list[int] = session.status.tolist()
    return status


@pytest.mark.arena("watches the eviction order")
def test_saving_only_new_chunks_with_context_leaves_the_head_the_most_recent(
    small_store: Store,
) -> None:
    """A save of a prompt's new chunks that names the chunks before them: without the context
    the new tail would be newer than the head, and ``x`` would evict a0."""
    assert save(small_store, "a0", "a1") == [GRANTED, GRANTED]
    assert save_after(small_store, ["a0", "a1"], "a2", "a3") == [GRANTED, GRANTED]
    assert evicted_by(small_store, ["a0", "a1", "a2", "a3"], "x") == ["a3"]


@pytest.mark.arena("watches the eviction order")
def test_a_write_touches_its_context_again_at_the_commit(small_store: Store) -> None:
    """A head used by another call between open_write and finish_write still ends up newer
    than the tail the commit adds."""
    assert save(small_store, "a0", "a1") == [GRANTED, GRANTED]
    session = small_store.open_write_with_context(["a2"], OBJ_BYTES, ["a0", "a1"])
    assert save(small_store, "z") == [GRANTED]  # newer than a0 and a1 now
    small_store.finish_write(session, np.ones(1, dtype=bool))
    assert evicted_by(small_store, ["a0", "a1", "a2", "z"], "x") == ["z"]


@pytest.mark.arena("fills the pool with one call's own prefix")
def test_a_save_never_evicts_its_context_for_its_own_keys(small_store: Store) -> None:
    assert save(small_store, "a0", "a1", "a2") == [GRANTED] * 3
    assert save_after(small_store, ["a0", "a1", "a2"], "a3", "a4") == [GRANTED, NO_SPACE]
    assert small_store.lookup(["a0", "a1", "a2", "a3"]).all()


@pytest.mark.arena("counts what a call allocates")
def test_context_keys_absent_from_the_pool_are_ignored(small_store: Store) -> None:
    assert save_after(small_store, ["gone0", "gone1"], "a2") == [GRANTED]
    u = usage(small_store)
    assert (u.objects, u.pending_writes, u.used) == (1, 0, OBJ_BYTES)
    found = small_store.lookup_with_context(["a2"], ["gone0", "gone1"])
    assert found.tolist() == [True]
    assert small_store.lookup(["gone0", "gone1"]).tolist() == [False, False]
    u = usage(small_store)
    assert (u.hits, u.misses, u.objects) == (1, 2, 1)  # the context is not counted


@pytest.mark.arena("watches leases and pending writes")
def test_a_leased_or_pending_key_named_as_context_is_left_alone(small_store: Store) -> None:
    save(small_store, "a0", "a1")
    held = small_store.open_read(["a0"])
    pending = small_store.open_write(["p"], OBJ_BYTES)
    context = ["a0", "p", "a1"]
    assert small_store.lookup_with_context(["a1"], context).tolist() == [True]
    read = small_store.open_read_with_context(["a1"], context)
    small_store.close_read(read)
    assert save_after(small_store, context, "n") == [GRANTED]
    u = usage(small_store)
    assert (u.leases, u.pending_writes, u.objects) == (1, 1, 3)
    assert small_store.lookup(["p"]).tolist() == [False]  # still invisible
    save(small_store, "x")  # the pool is full: evicts the only unleased, committed candidate
    assert small_store.lookup(["a0", "a1", "n", "x"]).tolist() == [True, True, False, True]
    small_store.finish_write(pending, np.ones(1, dtype=bool))
    small_store.close_read(held)
    assert small_store.lookup(["p", "a0"]).tolist() == [True, True]


@pytest.mark.arena("watches the eviction order")
def test_a_lookup_after_a_skipped_head_touches_it_last(small_store: Store) -> None:
    """An inference server's own cache holds a prompt's head: it looks up only the rest,
    naming the head as context, and the head ends up the most recent."""
    keys = ["a0", "a1", "a2", "a3"]
    save(small_store, *keys)
    small_store.lookup(["a2", "a3"])  # the tail newer than the head
    assert small_store.lookup_with_context(["a2", "a3"], ["a0", "a1"]).all()
    assert evicted_by(small_store, keys, "x") == ["a3"]


@pytest.mark.arena("watches the eviction order")
def test_a_load_after_a_skipped_head_touches_it_last(small_store: Store) -> None:
    keys = ["a0", "a1", "a2", "a3"]
    save(small_store, *keys)
    small_store.lookup(["a2", "a3"])
    session = small_store.open_read_with_context(["a2", "a3"], ["a0", "a1"])
    assert session.found.all()
    small_store.close_read(session)  # the leases rejoin, then the head is touched
    assert evicted_by(small_store, keys, "x") == ["a3"]


# -- many overlapping prompts through the engine ------------------------------------------------

BLOCK = 16  # tokens per block; one block per chunk
POOL_OBJECTS = 32  # the pool holds this many chunks
MAX_CHUNKS = 14  # the longest prompt
REQUESTS = 700


def prompt_mix(seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """A serving day in miniature: ``("serve", tokens)`` or ``("lookup", tokens)``.

    A few system prompts shared by many conversations; conversations that grow turn by turn
    (each turn's prompt extends the last one); exact repeats; lookups of earlier prompts and of
    prefixes of them. Lengths vary and need not be whole chunks.
    """
    rng = np.random.default_rng(seed)

    def text(chunks: int) -> np.ndarray:
        return rng.integers(0, 50_000, chunks * BLOCK + int(rng.integers(0, BLOCK)))

    systems = [rng.integers(0, 50_000, BLOCK * int(rng.integers(1, 4))) for _ in range(5)]
    talks: list[np.ndarray] = []
    served: list[np.ndarray] = []
    for _ in range(REQUESTS):
        roll = rng.random()
        if roll < 0.3 or not talks:
            system = systems[int(rng.integers(len(systems)))]
            tokens = np.concatenate([system, text(int(rng.integers(0, 5)))])
            talks.append(tokens)
        elif roll < 0.7:
            i = len(talks) - 1 - int(rng.integers(min(len(talks), 12)))
            tokens = np.concatenate([talks[i], text(int(rng.integers(1, 4)))])
            if len(tokens) > MAX_CHUNKS * BLOCK:  # the conversation ends; a new one starts
                tokens = tokens[: MAX_CHUNKS * BLOCK]
                talks.pop(i)
            else:
                talks[i] = tokens
        elif roll < 0.85:
            tokens = served[-1 - int(rng.integers(min(len(served), 40)))]
        else:
            earlier = served[-1 - int(rng.integers(min(len(served), 40)))]
            yield "lookup", earlier[: int(rng.integers(1, len(earlier) + 1))]
            continue
        served.append(tokens)
        yield "serve", tokens


def unreachable(store: Store, prompts: list[np.ndarray], space: KeySpace) -> list[str]:
    """Stored chunks that a lookup of no prompt reaches: a chunk before them is missing.
    Every stored chunk belongs to some prompt, so they are also counted against usage()."""
    stored: set[str] = set()
    reachable: set[str] = set()
    for tokens in prompts:
        keys = space.keys(chunk_hashes(tokens, BLOCK))
        found = store.lookup(keys)
        misses = np.flatnonzero(~found)
        run = int(misses[0]) if misses.size else len(keys)
        stored.update(k for k, f in zip(keys, found, strict=True) if f)
        reachable.update(keys[:run])
    assert len(stored) == usage(store).objects  # nothing stored that no prompt names
    return sorted(stored - reachable)


async def serve(engine: kvflow.TransferEngine, batch: list[np.ndarray]) -> int:
    """Serve prompts as a server would: a lookup of each, then one batch loading every hit and
    one batch saving every prompt whole (each prompt in blocks of its own). Chunks loaded."""
    hits = [await engine.lookup(tokens) for tokens in batch]
    first = np.cumsum([0] + [-(-len(tokens) // BLOCK) for tokens in batch])
    loads = [
        (tokens[:hit], np.arange(start, start + hit // BLOCK))
        for tokens, hit, start in zip(batch, hits, first, strict=False)
        if hit
    ]
    if loads:
        async with await engine.start_load(loads) as loading:
            assert (await loading.wait()).ok
    saves = [
        (tokens, np.arange(start, end))
        for tokens, start, end in zip(batch, first, first[1:], strict=False)
    ]
    async with await engine.start_save(saves) as saving:
        for layer in range(engine.layout.num_layers):
            await saving.layer_written(layer)
        await saving.wait()
    return sum(hits) // BLOCK


@pytest.mark.arena("fills the pool far past capacity to watch what eviction leaves")
async def test_eviction_leaves_no_stored_chunk_unreachable(store_name: str) -> None:
    """Hundreds of overlapping prompts through a TransferEngine (lookups, loads of the hits,
    saves of whole prompts, one or two prompts a batch: the engine's own calls), the pool a
    fraction of what they need. At every checkpoint each stored chunk's whole prefix is
    stored too."""
    caches = make_caches(2, 2 * MAX_CHUNKS)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BLOCK)
    slot = slot_bytes(layout.object_bytes(1))
    store = make_store(store_name, POOL_OBJECTS * slot)
    engine = kvflow.TransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=1))
    prompts: dict[bytes, np.ndarray] = {}
    batch: list[np.ndarray] = []
    hits = batches = 0
    try:
        for n, (what, tokens) in enumerate(prompt_mix(seed=7), start=1):
            prompts.setdefault(tokens.tobytes(), tokens)
            if what == "serve":
                batch.append(tokens)
                if len(batch) == 1 + batches % 2:  # one prompt a batch, then two
                    hits += await serve(engine, batch)
                    batch, batches = [], batches + 1
            else:
                await engine.lookup(tokens)
            if n % 100 == 0:
                lost = unreachable(store, list(prompts.values()), engine.keyspace)
                assert not lost, f"after {n} requests {len(lost)} stored chunks are unreachable"
        assert usage(store).evictions > 10 * POOL_OBJECTS  # the pool turned over many times
        assert hits > 2 * POOL_OBJECTS  # and served hits meanwhile
    finally:
        await engine.close()
        dispose(store)
