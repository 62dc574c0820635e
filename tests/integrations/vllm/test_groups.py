"""GroupPlanner, the scheduler side of several KV cache groups (vLLM's hybrid KV cache manager),
without vLLM.

What is tested: each group looks its chunks up in its own pool (the keys name the group:
``spec_fingerprint`` differs per group, and is unchanged for a lone group), once per request; a
request's hit is the longest chunk end that is a hit in every group, which is not the shortest
of the groups' own hits when a window needs chunks a shorter end does not; loads and saves are
planned per group into that group's block ids, vLLM's null block skipped in the windowed group
only; a failed load and a finished request are forgotten in every group. On the worker side
(``GroupWorkers``, in vLLM's interpreter), a request's asynchronous load ends when every group's
has, and fails when any group's failed.

A group-0 planner with a sliding window of 12 tokens (as Gemma 2's sliding layers) beside a
group-1 planner of full attention, both asynchronous, as the connector builds them.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from kvflow import SKIP_BLOCK
from kvflow.integrations.vllm.caches import spec_fingerprint
from kvflow.integrations.vllm.groups import GroupPlanner
from kvflow.integrations.vllm.planner import NULL_BLOCK, ChunkPlanner, Transfer
from tests.support.processes import REPO
from tests.support.vllm_planning import (
    BS,
    CB,
    CT,
    Clock,
    FakePool,
    FakeRequest,
    FullAttentionSpec,
    expected,
    per_chunk,
    request,
    vllm_table,
)

WINDOW = 12


def two_groups(window_pool: FakePool, full_pool: FakePool) -> GroupPlanner:
    """Group 0: a window of ``WINDOW`` tokens over ``window_pool``; group 1: full attention
    over ``full_pool``; loads asynchronous, as with any several groups."""
    return GroupPlanner(
        [
            ChunkPlanner(
                block_size=BS,
                chunk_blocks=CB,
                lookup=pool.lookup,
                window=window,
                async_loads=True,
                group=g,
                clock=Clock(),
            )
            for g, (pool, window) in enumerate(((window_pool, WINDOW), (full_pool, 0)))
        ]
    )


def match(p: GroupPlanner, req: FakeRequest, num_computed: int = 0) -> int:
    return p.matched_tokens(req.req_id, req.block_hashes, req.prompt_tokens, num_computed)


def by_group(transfers: list[Transfer], group: int) -> list[Transfer]:
    return [t for t in transfers if t.group == group]


def test_each_group_has_keys_of_its_own_and_a_lone_group_keeps_its_keys() -> None:
    spec = FullAttentionSpec()
    alone = spec_fingerprint(spec, num_layers=2, tp_size=1)
    first = spec_fingerprint(spec, num_layers=2, tp_size=1, group="0/2")
    second = spec_fingerprint(spec, num_layers=2, tp_size=1, group="1/2")

    assert len({alone, first, second}) == 3
    assert alone == spec_fingerprint(spec, num_layers=2, tp_size=1, group="")


def test_each_group_looks_up_its_own_pool_once() -> None:
    """Group 0's pool has chunks 0..4, group 1's 0..2: the hit is 3 chunks, and each pool was
    asked once for every chunk (the second round reuses the answers)."""
    window_pool, full_pool = FakePool(), FakePool()
    req = request("r", 5 * CT + 1)
    window_pool.store(req, range(5))
    full_pool.store(req, range(3))
    p = two_groups(window_pool, full_pool)

    assert match(p, req) == 3 * CT
    every = [[req.chunk_hash(c) for c in range(5)]]
    assert window_pool.calls == every
    assert full_pool.calls == every


@pytest.mark.parametrize(
    ("window_stored", "full_stored", "hit"),
    [
        ({0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, 5),
        ({0, 1, 2, 3, 4}, {0, 1}, 2),
        # the window's own hit is 5 (chunks 3 and 4), full attention's 4; ending at 4 needs
        # chunks 2 and 3 in the window's group, and chunk 2 is missing: no hit
        ({3, 4}, {0, 1, 2, 3}, 0),
        ({1, 2, 4}, {0, 1, 2, 3, 4}, 3),  # the window's: 3 (chunks 1 and 2)
        ({1, 2, 3, 4}, {0, 1, 2, 3}, 4),  # ending at 4: chunks 2 and 3 in the window's
    ],
)
def test_the_hit_is_the_longest_end_that_is_a_hit_in_every_group(
    window_stored: set[int], full_stored: set[int], hit: int
) -> None:
    window_pool, full_pool = FakePool(), FakePool()
    req = request("r", 5 * CT + 1)
    window_pool.store(req, window_stored)
    full_pool.store(req, full_stored)

    assert match(two_groups(window_pool, full_pool), req) == hit * CT


def test_loads_and_saves_are_planned_per_group_into_its_own_blocks() -> None:
    """A hit of 4 chunks (group 1 lacks chunk 4): group 0 loads the chunks of token 32's
    window (2 and 3; vLLM's null block for blocks 0..4, its place skipped), group 1 every
    chunk, each into its own block table. The step then saves chunk 4 in each group, from
    that group's blocks."""
    window_pool, full_pool = FakePool(), FakePool()
    req = request("r", 5 * CT + 1)
    window_pool.store(req, range(5))
    full_pool.store(req, range(4))
    p = two_groups(window_pool, full_pool)
    assert p.async_loads
    assert match(p, req) == 4 * CT
    window_table = vllm_table(req, WINDOW, 4 * CT)
    full_table = [300 + i for i in range(len(window_table))]
    assert window_table[:5] == [NULL_BLOCK] * 5

    p.allocated(req.req_id, 4 * CT, (window_table, full_table))
    loads = p.take_async_loads()

    (w,) = by_group(loads, 0)
    (f,) = by_group(loads, 1)
    assert (w.first_chunk, w.hashes) == (2, (req.chunk_hash(2), req.chunk_hash(3)))
    assert w.block_ids == (SKIP_BLOCK, 105, 106, 107)
    assert (f.first_chunk, f.block_ids) == (0, tuple(full_table[: 4 * CB]))
    assert f.hashes == tuple(req.chunk_hash(c) for c in range(4))

    sync_loads, saves = p.step(
        [(req.req_id, (window_table, full_table), True, 4 * CT, req.prompt_tokens - 4 * CT)]
    )
    assert sync_loads == []
    assert per_chunk(by_group(saves, 0)) == expected(req, [4], window_table)
    assert per_chunk(by_group(saves, 1)) == expected(req, [4], full_table)
    assert len(saves) == 2


def test_new_blocks_of_a_running_request_go_to_their_group() -> None:
    """A request prefilled a chunk a step: each step's new block ids are per group, and each
    group saves its chunk from its own."""
    p = two_groups(FakePool(), FakePool())
    req = request("r", 2 * CT + 1)
    assert match(p, req) == 0
    p.allocated(req.req_id, 0)

    _, s1 = p.step([(req.req_id, ([10, 11], [20, 21]), True, 0, CT)])
    _, s2 = p.step([(req.req_id, ([12, 13], [22, 23]), False, CT, CT)])
    _, s3 = p.step([(req.req_id, None, False, 2 * CT, 1)])

    assert [(t.group, t.first_chunk, t.block_ids) for t in s1 + s2] == [
        (0, 0, (10, 11)),
        (1, 0, (20, 21)),
        (0, 1, (12, 13)),
        (1, 1, (22, 23)),
    ]
    assert s3 == []


def test_a_failed_load_and_a_finished_request_are_forgotten_in_every_group() -> None:
    window_pool, full_pool = FakePool(), FakePool()
    req = request("r", 3 * CT + 1)
    window_pool.store(req, range(3))
    full_pool.store(req, range(3))
    p = two_groups(window_pool, full_pool)

    assert match(p, req) == 3 * CT
    p.load_failed(req.req_id)
    assert match(p, req) == 0  # vLLM computes it from its first token
    assert [q.tracked for q in p.planners] == [1, 1]
    p.finished(req.req_id)
    assert [q.tracked for q in p.planners] == [0, 0]
    assert match(p, req) == 3 * CT  # the same id starts afresh


def test_one_group_is_its_planner() -> None:
    """A lone full-attention group: synchronous loads, the planner's hit."""
    pool = FakePool()
    req = request("r", 3 * CT + 1)
    pool.store(req, range(2))
    p = GroupPlanner([ChunkPlanner(block_size=BS, chunk_blocks=CB, lookup=pool.lookup)])

    assert not p.async_loads
    assert match(p, req) == 2 * CT
    assert len(pool.calls) == 1
    p.allocated(req.req_id, 2 * CT)
    loads, _ = p.step([(req.req_id, ([7, 8, 9, 10, 11, 12, 13],), True, 2 * CT, CT + 1)])
    assert [(t.group, t.block_ids) for t in loads] == [(0, (7, 8, 9, 10))]


def test_groups_of_other_chunk_sizes_are_refused() -> None:
    pool = FakePool()
    with pytest.raises(AssertionError):
        GroupPlanner(
            [
                ChunkPlanner(block_size=BS, chunk_blocks=CB, lookup=pool.lookup),
                ChunkPlanner(block_size=BS, chunk_blocks=2 * CB, lookup=pool.lookup),
            ]
        )


def test_transfers_are_of_group_zero_by_default() -> None:
    assert Transfer("r", (), (), 0).group == 0


# -- the worker side: a request's asynchronous load across groups (vLLM's interpreter) ---------

WORKERS_SCRIPT = textwrap.dedent(
    """
    import json

    from kvflow.integrations.vllm.group_workers import GroupWorkers
    from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
    from kvflow.integrations.vllm.planner import Transfer

    class Worker:  # one group's worker: which loads ended, step by step
        def __init__(self, steps):
            self.steps, self.bound = list(steps), []

        def bind(self, meta):
            self.bound.append([t.req_id for t in meta.async_loads])

        def finished_async_loads(self):
            finished, failed = self.steps.pop(0)
            return set(finished), set(failed)

    workers = GroupWorkers.__new__(GroupWorkers)
    workers.workers = [
        Worker([(["a", "b"], []), ([], [])]),  # group 0: both end at once, well
        Worker([(["b"], []), (["a"], ["a"])]),  # group 1: b well, then a failed
    ]
    workers._pending, workers._failed = {}, set()
    loads = [Transfer(r, (), (), 0, group=g) for r in "ab" for g in (0, 1)]
    workers.bind(KVFlowConnectorMetadata(async_loads=loads))
    steps = [[sorted(s) for s in workers.finished_async_loads()] for _ in range(2)]
    print(json.dumps({"bound": [w.bound for w in workers.workers], "steps": steps}))
    """
)


def test_a_requests_load_ends_when_every_groups_has_and_fails_when_any_failed(
    vllm_python: str,
) -> None:
    """Each group's worker is bound its own group's loads; request b is reported once both
    groups loaded it, a once its second group's load failed, as failed."""
    proc = subprocess.run(
        [vllm_python, "-c", WORKERS_SCRIPT], cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert out["bound"] == [[["a", "b"]], [["a", "b"]]]
    assert out["steps"] == [[["b"], []], [["a"], ["a"]]]  # per step: ended, failed


ROUTING_SCRIPT = textwrap.dedent(
    """
    import json
    from types import SimpleNamespace as NS

    from kvflow.integrations.vllm import group_workers

    class Worker:  # records what the group's worker is given
        def __init__(self, config, group, vllm_config):
            self.layers, self.hooks = [], []

        def register_kv_caches(self, caches, open_store):
            self.layers = sorted(caches)

        def wait_for_layer_load(self, name):
            self.hooks.append(["load", name])

        def save_kv_layer(self, name):
            self.hooks.append(["save", name])

    group_workers.KVFlowConnectorWorker = Worker
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    groups = [NS(layer_names=names[0::2]), NS(layer_names=names[1::2])]  # as Gemma 2's
    workers = group_workers.GroupWorkers(NS(), groups, NS())
    workers.register_kv_caches({name: object() for name in names})
    for name in names + ["model.layers.9.self_attn.attn"]:  # the last in no group
        workers.wait_for_layer_load(name)
        workers.save_kv_layer(name)
    print(json.dumps([[w.layers, w.hooks] for w in workers.workers]))
    """
)


def test_each_layer_goes_to_its_groups_worker(vllm_python: str) -> None:
    """``GroupWorkers`` gives each group's worker exactly that group's layers (vLLM's layer
    names, interleaved as a model that alternates attention kinds), and sends each layer's
    hooks to that worker only; a layer of no group goes nowhere."""
    proc = subprocess.run(
        [vllm_python, "-c", ROUTING_SCRIPT], cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    for g, (layers, hooks) in enumerate(out):
        mine = names[g::2]
        assert layers == mine
        assert hooks == [[hook, name] for name in mine for hook in ("load", "save")]
