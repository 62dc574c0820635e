"""BoundedCaller: calls on helper threads, each bounded in time, with its four choices (pinning,
what a late result does, refusing calls while a timed-out one runs, how errors are mapped)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

import kvflow
from kvflow.bounded import BoundedCaller
from tests.support.threads import start_a_thread

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
LONG_S = 60.0  # a call that must not time out, or a wait for another thread: far above a stall


def test_a_call_returns_its_result_and_raises_what_it_raised() -> None:
    calls = BoundedCaller("pool", LONG_S)
    try:
        assert calls.call("add", lambda a, b: a + b, 2, 3) == 5

        def fail() -> None:
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            calls.call("fail", fail)
        assert "threads=1/1" in repr(calls)  # one thread served both calls
    finally:
        calls.shutdown()


def test_errors_maps_what_a_call_raised_and_none_passes_it_on() -> None:
    def mapped(what: str, exc: BaseException) -> BaseException | None:
        return kvflow.StoreError(f"{what} failed: {exc}") if isinstance(exc, ValueError) else None

    calls = BoundedCaller("engine", LONG_S, errors=mapped)
    try:
        with pytest.raises(kvflow.StoreError, match="engine open failed: bad") as info:
            calls.call("open", _raise, ValueError("bad"))
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(KeyError):
            calls.call("open", _raise, KeyError("k"))
    finally:
        calls.shutdown()


def test_a_timeout_raises_and_a_late_result_goes_to_on_late() -> None:
    release, handed = threading.Event(), threading.Event()
    late: list[str] = []

    def take(value: str) -> None:
        late.append(value)
        handed.set()

    calls = BoundedCaller("pool", 0.2, on_late=take)
    try:
        with pytest.raises(kvflow.TransferTimeoutError, match=r"pool open did not finish within"):
            calls.call("open", _wait_then, release, "store")
        release.set()
        assert handed.wait(60) and late == ["store"]
        calls.timeout_s = LONG_S  # the next call must not time out on a stalled machine
        assert calls.call("open", lambda: "next") == "next"  # not refused: refuse_late is off
    finally:
        calls.shutdown()


def test_a_calls_own_on_late_takes_its_late_result_and_a_failing_one_ends_no_thread() -> None:
    release, handed = threading.Event(), threading.Event()
    for_all: list[str] = []
    own: list[object] = []

    def mine(value: str) -> None:
        own.extend((value, threading.get_ident()))
        handed.set()
        raise RuntimeError("a handler that fails")  # logged; the thread serves on

    calls = BoundedCaller("pool", 0.2, on_late=for_all.append)
    try:
        with pytest.raises(kvflow.TransferTimeoutError):
            calls.call("start", _wait_then, release, "sessions", on_late=mine)
        release.set()
        assert handed.wait(60) and own[0] == "sessions" and for_all == []
        calls.timeout_s = LONG_S
        assert calls.call("next", threading.get_ident) == own[1]  # the same thread, serving
    finally:
        calls.shutdown()


def test_refuse_late_fails_new_calls_at_once_while_a_timed_out_one_runs() -> None:
    release = threading.Event()
    calls = BoundedCaller("pool", 0.2, refuse_late=True)
    try:
        with pytest.raises(kvflow.TransferTimeoutError):
            calls.call("lookup", _wait_then, release, 1)
        with pytest.raises(TimeoutError, match="an earlier pool lookup"):
            calls.call("lookup", lambda: 2)
        release.set()
        assert _until(lambda: "late=0" in repr(calls))
        calls.timeout_s = LONG_S  # the next call must not time out on a stalled machine
        assert calls.call("lookup", lambda: 3) == 3
        assert "threads=1/1" in repr(calls)  # never more than one thread
    finally:
        calls.shutdown()


def test_timeout_error_chooses_what_a_timeout_raises() -> None:
    release = threading.Event()
    calls = BoundedCaller(
        "memcache",
        0.1,
        timeout_error=lambda what, t: kvflow.StoreUnavailableError(f"{what} after {t:g} s"),
    )
    try:
        with pytest.raises(kvflow.StoreUnavailableError, match=r"memcache init after 0.1 s"):
            calls.call("init", _wait_then, release, 0)
    finally:
        release.set()
        calls.shutdown()


def test_calls_wait_for_a_free_thread_within_their_time() -> None:
    release = threading.Event()
    calls = BoundedCaller("pool", 0.2, threads=1)
    try:
        with pytest.raises(kvflow.TransferTimeoutError):
            calls.call("a", _wait_then, release, 1)
        with pytest.raises(kvflow.TransferTimeoutError):  # queued behind the hung call
            calls.call("b", lambda: 2)
        release.set()
    finally:
        calls.shutdown()


def test_shutdown_refuses_new_calls_and_ends_its_threads() -> None:
    before = threading.active_count()
    calls = BoundedCaller("pool", LONG_S, threads=3)
    assert calls.call("a", lambda: 1) == 1
    calls.shutdown()
    with pytest.raises(kvflow.ClosedError):
        calls.call("a", lambda: 1)
    assert _until(lambda: threading.active_count() <= before)


@pytest.mark.skipif(not CPUS, reason="CPU affinity is a Linux feature")
def test_threads_pin_to_cpus_and_threads_they_start_inherit_it() -> None:
    target = (CPUS[-1],)

    calls = BoundedCaller("pinned", LONG_S, cpus=target)
    try:
        assert calls.call("", start_a_thread) == list(target)
        assert sorted(os.sched_getaffinity(0)) == CPUS, "the caller was re-pinned"
    finally:
        calls.shutdown()


def _raise(exc: BaseException) -> None:
    raise exc


def _wait_then(event: threading.Event, value: object) -> object:
    assert event.wait(LONG_S)
    return value


def _until(condition: Callable[[], bool], timeout_s: float = LONG_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
