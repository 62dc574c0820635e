"""The batched copy loop: the native path and the Python fallback copy the same bytes."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.copying import host as copyloop
from kvflow.errors import ConfigError

PATHS = [pytest.param((False, None), id="python")]
if copyloop.NATIVE:  # both ways the native loop can copy, whatever this machine chose
    PATHS.append(pytest.param((True, 0), id="native-memcpy"))
    if copyloop._STREAMING:
        PATHS.append(pytest.param((True, copyloop.STREAM_MIN_BYTES), id="native-streamed"))


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)
def test_native_loop_is_built_where_a_compiler_is() -> None:
    """Where a compiler is present the install builds the native loop: it must not go missing
    silently (without a compiler kvflow falls back to the Python loop, by design)."""
    assert copyloop.NATIVE


@pytest.mark.parametrize("native", PATHS)
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * copyloop.STREAM_MIN_BYTES), min_size=0, max_size=12),
    src_skew=st.integers(0, 63),
    dst_skew=st.integers(0, 63),
    seed=st.integers(0, 2**32 - 1),
)
def test_copy_ranges_moves_exactly_the_ranges(native, sizes, src_skew, dst_skew, seed) -> None:
    native, stream_min = native
    rng = np.random.default_rng(seed)
    total = sum(sizes) + 64 * len(sizes) + 128
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    want = dst.copy()
    # ranges at odd alignments, in shuffled order, with gaps that must stay untouched
    order = rng.permutation(len(sizes))
    s_off, d_off = src_skew, dst_skew
    srcs, dsts = [], []
    for n in sizes:
        srcs.append(s_off)
        dsts.append(d_off)
        s_off += n + 32
        d_off += n + 32
    srcs = [srcs[i] for i in order]
    dsts = [dsts[i] for i in order]
    sizes = [sizes[i] for i in order]
    for s, d, n in zip(srcs, dsts, sizes, strict=True):
        want[d : d + n] = src[s : s + n]
    copyloop.copy_ranges(
        dst.ctypes.data + np.array(dsts, dtype=np.int64),
        src.ctypes.data + np.array(srcs, dtype=np.int64),
        np.array(sizes, dtype=np.int64),
        native=native,
        stream_min=stream_min,
    )
    assert np.array_equal(dst, want)


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The process's streaming choice forgotten, so that the test makes it again."""
    monkeypatch.setattr(copyloop, "_stream_min", None)
    monkeypatch.delenv("KVFLOW_STREAM_COPY", raising=False)
    return monkeypatch


@pytest.mark.parametrize(("setting", "expected"), [("1", copyloop.STREAM_MIN_BYTES), ("0", 0)])
def test_the_environment_decides_streaming(
    fresh_choice: pytest.MonkeyPatch, setting: str, expected: int
) -> None:
    if not copyloop.NATIVE or not copyloop._STREAMING:
        expected = 0  # nothing can stream without the native loop's x86-64 build
    fresh_choice.setenv("KVFLOW_STREAM_COPY", setting)
    fresh_choice.setattr(copyloop, "_time_both", lambda: pytest.fail("measured anyway"))

    assert copyloop.stream_min_bytes() == expected


@pytest.mark.parametrize(
    ("times", "expected"), [((1.0, 2.0), copyloop.STREAM_MIN_BYTES), ((2.0, 1.0), 0)]
)
def test_by_default_the_faster_way_is_kept(
    fresh_choice: pytest.MonkeyPatch, times: tuple[float, float], expected: int
) -> None:
    if not copyloop.NATIVE or not copyloop._STREAMING:
        pytest.skip("the native loop cannot stream here")
    calls = []
    fresh_choice.setattr(copyloop, "_time_both", lambda: calls.append(1) or times)

    assert copyloop.stream_min_bytes() == expected
    assert copyloop.stream_min_bytes() == expected
    assert calls == [1]  # measured once per process


def test_a_bad_setting_is_refused_by_name(fresh_choice: pytest.MonkeyPatch) -> None:
    fresh_choice.setenv("KVFLOW_STREAM_COPY", "yes")

    with pytest.raises(ConfigError) as info:
        copyloop.stream_min_bytes()

    assert info.value.argument == "KVFLOW_STREAM_COPY"
    assert "yes" in str(info.value)


def test_threads_that_ask_at_once_measure_once(fresh_choice: pytest.MonkeyPatch) -> None:
    if not copyloop.NATIVE or not copyloop._STREAMING:
        pytest.skip("the native loop cannot stream here")
    calls = []

    def slow() -> tuple[float, float]:
        calls.append(1)
        time.sleep(0.05)
        return 1.0, 2.0

    fresh_choice.setattr(copyloop, "_time_both", slow)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: copyloop.stream_min_bytes(), range(8)))

    assert answers == [copyloop.STREAM_MIN_BYTES] * 8
    assert calls == [1]


@pytest.mark.skipif(not copyloop.NATIVE, reason="the native loop is not built")
def test_copy_ranges_uses_the_process_choice_by_default(fresh_choice: pytest.MonkeyPatch) -> None:
    seen = []
    fresh_choice.setattr(copyloop, "_stream_min", 12345)
    fresh_choice.setattr(copyloop, "_native", lambda d, s, n, stream_min: seen.append(stream_min))
    one = np.zeros(1, dtype=np.int64)

    copyloop.copy_ranges(one, one, one)
    copyloop.copy_ranges(one, one, one, stream_min=0)

    assert seen == [12345, 0]


@pytest.mark.skipif(not copyloop.NATIVE, reason="the native loop is not built")
def test_timing_both_ways_gives_two_durations() -> None:
    streamed, plain = copyloop._time_both(total=4 << 20, piece=1 << 20, rounds=1)

    assert 0 < streamed < 1 and 0 < plain < 1


@pytest.mark.parametrize(
    ("former", "now"),
    [
        ("kvflow.stores.copyloop", "kvflow.copying.host"),
        ("kvflow.cuda", "kvflow.copying.cuda"),
        ("kvflow.integrations.vllm.random_model", "kvflow.testing.models"),
        ("kvflow.pool.store_config", "kvflow.pool.config"),
    ],
)
def test_a_former_module_name_still_imports_and_says_where_it_went(former: str, now: str) -> None:
    import importlib
    import sys

    sys.modules.pop(former, None)  # its warning comes at its first import
    with pytest.warns(DeprecationWarning, match=now.replace(".", r"\.")):
        module = importlib.import_module(former)
    current = importlib.import_module(now)
    assert all(getattr(module, name) is getattr(current, name) for name in module.__all__)
