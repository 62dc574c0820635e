"""How a fault run's requests are split into before, during and after (``hostfaults.summarize``),
on events written out here: recovery is every prompt hitting in full again in a request started
once the fault was undone, and the first full hit alone is not it."""

from __future__ import annotations

from typing import Any

from kvflow.bench.hostfaults import LOOP_ARGS, summarize

CHUNKS = int(LOOP_ARGS["chunks"])
PROMPTS = len(LOOP_ARGS["prompts"])


def _event(t: float, prompt: int, ok: int) -> dict[str, Any]:
    event = {"t": t, "prompt": prompt, "hit_chunks": ok, "ok": ok, "failed": 0, "missing": 0}
    event.update(wrong=0, hung=False, lookup_s=0.01)
    return event if ok == CHUNKS else {**event, "save_s": 0.02}  # what missed is saved again


def _pass(start: float, ok: int, prompts: range = range(PROMPTS)) -> list[dict[str, Any]]:
    return [_event(start + i, p, ok) for i, p in enumerate(prompts)]


def test_recovery_is_every_prompt_hitting_in_full_again() -> None:
    made, undone = 100.0, 105.0
    # before: a warm pass; during: half the prompts still miss after the undo; then a pass in
    # which the rest hit in full one by one, and a pass after that
    events = _pass(80.0, CHUNKS) + _pass(100.0, 0, range(6))
    events += [_event(106.0 + i, p, CHUNKS if p % 2 else 1) for i, p in enumerate(range(12))]
    events += [_event(118.0 + i, p, CHUNKS) for i, p in enumerate(range(0, 12, 2))]
    events += _pass(124.0, CHUNKS)
    s = summarize(events, made, undone)
    assert s["recovered_s"] == 2.0  # prompt 1, started at 107
    assert s["all_recovered_s"] == 18.0  # prompt 10's first full hit, started at 123
    assert s["before"]["requests"] == PROMPTS and s["before"]["full_hits"] == PROMPTS
    assert s["during"]["requests"] == 6 + 12 + 6  # through the request that recovered
    assert s["during"]["full_hits"] == 6 + 6
    after = s["after"]
    assert (after["requests"], after["full_hits"], after["not_found"]) == (PROMPTS, PROMPTS, 0)


def test_a_full_hit_before_the_undo_does_not_count() -> None:
    events = _pass(0.0, CHUNKS) + _pass(20.0, CHUNKS)  # every request hits, before the undo too
    s = summarize(events, made=12.0, undone=25.0)
    assert s["recovered_s"] == 0.0 and s["all_recovered_s"] is None  # prompts 0-4 not since
    s = summarize(events + _pass(40.0, CHUNKS), made=12.0, undone=25.0)
    assert s["all_recovered_s"] == 19.0  # prompt 4, started at 44
    assert s["during"]["requests"] == PROMPTS + 5 and s["after"]["requests"] == PROMPTS - 5


def test_a_prompt_that_never_hits_again_is_no_recovery() -> None:
    events = _pass(0.0, CHUNKS) + _pass(20.0, CHUNKS, range(PROMPTS - 1)) + [_event(40.0, 11, 2)]
    s = summarize(events, made=12.0, undone=15.0)
    assert s["recovered_s"] == 5.0 and s["all_recovered_s"] is None
    assert s["during"]["requests"] == PROMPTS and s["after"]["requests"] == 0
    assert summarize(_pass(0.0, 0), made=0.0, undone=0.0)["recovered_s"] is None
