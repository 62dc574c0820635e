"""vLLM's ``kv_role`` in real vLLM, offline, on a private shared pool; and a forward that raises.

A ``kv_producer`` loads and saves; a ``kv_consumer`` loads what the producer saved and saves
nothing (its counters say what it computed and did not store), unless ``save_decode_cache``,
with which it stores its prompt and the chunks of the tokens it generated, under the keys a
follow-up turn looks up. A forward that raises ends its step's load and save at once (no wait
for layers that will never come), stores nothing of the step, and vLLM sees the model's error.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.vllm import (
    CHUNK,
    A,
    C,
    VllmRun,
    cached,
    counter,
    hit,
    objects,
    random_tokens,
    shared_extra,
    tokens,
)


@pytest.fixture(scope="module")
def baseline(vllm: VllmRun) -> list[list[int]]:
    """Greedy tokens of vLLM without a connector for A and C."""
    return tokens(vllm([A, C]))


def test_a_consumer_loads_what_the_producer_saved_and_saves_nothing(
    vllm: VllmRun, baseline: list[list[int]], pool_dir: str
) -> None:
    extra = shared_extra(pool_dir)
    produced = vllm([A], extra=extra, kv_role="kv_producer", counters=True)
    assert counter(produced, "saved_tokens") == len(A) // CHUNK * CHUNK
    assert tokens(produced) == [baseline[0]]
    stored = objects(pool_dir)

    consumed = vllm([A, C], extra=extra, kv_role="kv_consumer", counters=True)

    assert cached(consumed) == [hit(A), 0]
    assert tokens(consumed) == baseline
    assert counter(consumed, "saved_tokens") == 0
    assert counter(consumed, "role_unsaved_tokens") == len(C) // CHUNK * CHUNK
    assert objects(pool_dir) == stored
    assert "kvflow: kv_consumer: looks up and loads, saves nothing" in consumed["log"]


def test_a_consumer_with_save_decode_cache_stores_prompt_and_generated_chunks(
    vllm: VllmRun, pool_dir: str
) -> None:
    """A follow-up turn (the prompt, the answer, a new question) then hits the answer too."""
    generated = 80
    extra = shared_extra(pool_dir, save_decode_cache=True)
    first = vllm([C], extra=extra, kv_role="kv_consumer", counters=True, max_tokens=generated)
    # the chunks of every token but the last (whose KV is never computed)
    final = (len(C) + generated - 1) // CHUNK * CHUNK
    assert counter(first, "saved_tokens") == final
    assert counter(first, "role_unsaved_tokens") == 0
    assert objects(pool_dir) == final // CHUNK

    follow_up = C + tokens(first)[0] + random_tokens(40, 31)
    reference = tokens(vllm([follow_up]))
    warm = vllm([follow_up], extra=extra, kv_role="kv_both")
    assert cached(warm) == [final]
    assert tokens(warm) == reference


def test_a_forward_that_raises_stops_its_steps_transfers_at_once(
    vllm: VllmRun, pool_dir: str
) -> None:
    """The failing step loads C (saved by a first run) and saves A's chunks; layer 2 of 4
    raises. With an operation timeout longer than the run may take, a wait for the layers that
    never come would end the run by its time limit instead of the model's error."""
    extra: dict[str, Any] = shared_extra(pool_dir, op_timeout_s=300.0)
    vllm([C], extra=extra)
    stored = objects(pool_dir)

    failed = vllm([C, A], extra=extra, fail_layer=2)

    assert "the model failed at layer 2" in failed["error"]
    assert "forward stopped after layer 1 of 3" in failed["log"]
    assert "did not finish" not in failed["log"]
    assert objects(pool_dir) == stored  # nothing of A's chunks
