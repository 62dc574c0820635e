"""The pieces of ``kvflow bench pool``'s eviction figures, without a pool server: the prompt mix,
the model of the policy before, the replay and its checks of the sizes it is given."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow import ConfigError, LocalStore
from kvflow.bench import eviction
from kvflow.bench.eviction import OBJECT_BYTES, PlainLru, prompt_mix, replay


def test_the_mix_is_deterministic_and_shares_prefixes() -> None:
    trace = prompt_mix(300, seed=3)
    assert trace == prompt_mix(300, seed=3)
    served = [r.keys for r in trace if r.serve]
    # a next turn extends an earlier prompt: its chunks start with all of that prompt's
    extended = sum(
        any(len(b) > len(a) > 0 and b[: len(a)] == a for a in served[max(0, i - 30) : i])
        for i, b in enumerate(served)
    )
    assert extended > len(served) // 4
    assert any(not r.serve for r in trace)


def test_the_model_of_the_policy_before_evicts_a_prefix_head_first() -> None:
    pool = PlainLru(4)
    keys = ["a0", "a1", "a2", "a3"]
    session = pool.open_write(keys, OBJECT_BYTES)
    pool.finish_write(session, np.ones(4, dtype=bool))
    session = pool.open_write(["x"], OBJECT_BYTES)
    pool.finish_write(session, np.ones(1, dtype=bool))
    assert pool.lookup(keys).tolist() == [False, True, True, True]  # a1..a3: unreachable


def test_the_model_matches_the_pools_where_no_eviction_happens() -> None:
    """With room for everything the policies cannot differ: same hits, all reachable."""
    trace = prompt_mix(200, seed=1)
    chunks = len({k for r in trace for k in r.keys})
    model = PlainLru(chunks)
    store = LocalStore(chunks * OBJECT_BYTES)
    try:
        for pattern in eviction.PATTERNS:
            assert replay(model, trace, pattern) == replay(store, trace, pattern)
        assert eviction.reachable_share(store, trace) == 1.0
        assert store.usage().evictions == 0
    finally:
        store.close()


def test_new_chunk_saves_naming_the_chunks_before_keep_every_stored_chunk_reachable() -> None:
    """Under pressure (16 chunks for 300 requests), saves of only the new chunks leave chunks no
    lookup reaches unless each names the chunks before it; naming them keeps all reachable and
    the model of the old policy, which has no context, is unchanged by it."""
    trace = prompt_mix(300, seed=0)
    shares = {}
    for pattern in ("new", "new_context"):
        store = LocalStore(16 * OBJECT_BYTES)
        try:
            replay(store, trace, pattern)
            shares[pattern] = eviction.reachable_share(store, trace)
        finally:
            store.close()
    assert shares["new"] < 0.9
    assert shares["new_context"] == 1.0
    assert replay(PlainLru(16), trace, "new") == replay(PlainLru(16), trace, "new_context")


@pytest.mark.parametrize(
    ("sizes", "option"),
    [
        ((0, 8, 1), "--eviction-requests"),
        ((100, 0, 1), "--eviction-pool"),
        ((100, 8, 0), "--eviction-checkpoints"),
        ((2, 8, 3), "--eviction-checkpoints"),
        ((100, True, 1), "--eviction-pool"),
    ],
)
def test_bad_sizes_are_refused_naming_the_option(sizes: tuple[int, int, int], option: str) -> None:
    with pytest.raises(ConfigError) as info:
        eviction.run(*sizes)
    assert info.value.argument == option
    assert option in str(info.value)
