"""Pool keys: prefix-chained chunk hashes and the namespaces they live under."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
import torch

from kvflow import InvalidArgumentError
from kvflow.keys import KeySpace, chunk_hashes, token_array

REPO = Path(__file__).resolve().parents[1]


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.int64)


# -- chunk_hashes -----------------------------------------------------------------------------


def test_chunk_hashes_has_one_digest_per_full_chunk() -> None:
    tokens = _tokens(50)

    hashes = chunk_hashes(tokens, 16)

    assert len(hashes) == 3  # 48 tokens in full chunks, 2 left over
    assert all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
    assert len(set(hashes)) == 3


def test_chunk_hashes_ignores_the_partial_tail() -> None:
    tokens = _tokens(64)

    assert chunk_hashes(tokens[:63], 16) == chunk_hashes(tokens[:48], 16)
    assert chunk_hashes(tokens[:64], 16)[:3] == chunk_hashes(tokens[:48], 16)
    assert len(chunk_hashes(tokens[:64], 16)) == 4


def test_chunk_hashes_of_fewer_tokens_than_a_chunk_is_empty() -> None:
    assert chunk_hashes(_tokens(15), 16) == []
    assert chunk_hashes(np.zeros(0, np.int64), 16) == []


def test_changing_a_token_in_the_first_chunk_changes_every_hash() -> None:
    tokens = _tokens(80)
    changed = tokens.copy()
    changed[3] += 1

    before, after = chunk_hashes(tokens, 16), chunk_hashes(changed, 16)

    assert len(before) == len(after) == 5
    assert all(a != b for a, b in zip(before, after, strict=True))


def test_changing_a_token_in_a_later_chunk_keeps_earlier_hashes() -> None:
    tokens = _tokens(80)
    changed = tokens.copy()
    changed[2 * 16 + 7] += 1

    before, after = chunk_hashes(tokens, 16), chunk_hashes(changed, 16)

    assert before[:2] == after[:2]
    assert all(a != b for a, b in zip(before[2:], after[2:], strict=True))


def test_equal_chunks_after_different_prefixes_hash_differently() -> None:
    chunk = _tokens(16, seed=1)
    a = np.concatenate([_tokens(16, seed=2), chunk])
    b = np.concatenate([_tokens(16, seed=3), chunk])

    assert chunk_hashes(a, 16)[1] != chunk_hashes(b, 16)[1]
    # and a chunk's hash is not the hash of that chunk alone
    assert chunk_hashes(a, 16)[1] != chunk_hashes(chunk, 16)[0]


def test_chunk_boundaries_are_part_of_the_hash() -> None:
    tokens = _tokens(32)

    assert chunk_hashes(tokens, 16)[-1] != chunk_hashes(tokens, 32)[0]
    assert chunk_hashes(tokens, 8)[1] != chunk_hashes(tokens, 16)[0]


def test_chunk_hashes_is_the_same_for_list_numpy_and_torch_inputs() -> None:
    values = _tokens(40).tolist()
    expected = chunk_hashes(np.array(values, np.int64), 8)

    inputs = [
        values,
        np.array(values, np.int32),
        np.array(values, np.uint32),
        np.array(values, ">i8"),
        np.repeat(np.array(values, np.int64), 2)[::2],  # strided view
        torch.tensor(values),
        torch.tensor(values, dtype=torch.int32),
    ]
    for given in inputs:
        assert chunk_hashes(token_array(given), 8) == expected
        if isinstance(given, np.ndarray):
            assert chunk_hashes(given, 8) == expected
    assert chunk_hashes(values, 8) == expected
    assert chunk_hashes(torch.tensor(values), 8) == expected


@pytest.mark.parametrize("chunk_tokens", [0, -1])
def test_chunk_hashes_refuses_a_chunk_size_below_one(chunk_tokens: int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        chunk_hashes(_tokens(16), chunk_tokens)

    assert info.value.argument == "chunk_tokens"
    assert info.value.value == chunk_tokens


_CHILD = """
import json, sys
import numpy as np
from kvflow.keys import KeySpace, chunk_hashes
tokens = np.arange(1000, 1100, dtype=np.int64) * 7
hashes = [h.hex() for h in chunk_hashes(tokens, 16)]
space = KeySpace.for_layout(
    model="org/model", layout_fingerprint="abc123", chunk_blocks=4, num_layers=2, rank=1
)
json.dump({"hashes": hashes, "keys": space.keys(chunk_hashes(tokens, 16))}, sys.stdout)
"""


def _run_child(hash_seed: str) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    out: dict[str, list[str]] = json.loads(done.stdout)
    return out


def test_chunk_hashes_and_keys_are_identical_across_processes() -> None:
    tokens = np.arange(1000, 1100, dtype=np.int64) * 7
    here = [h.hex() for h in chunk_hashes(tokens, 16)]
    space = KeySpace.for_layout(
        model="org/model", layout_fingerprint="abc123", chunk_blocks=4, num_layers=2, rank=1
    )

    first = _run_child("1")
    second = _run_child("4242")

    assert len(here) == 6
    assert first["hashes"] == second["hashes"] == here
    assert first["keys"] == second["keys"] == space.keys(chunk_hashes(tokens, 16))


# -- token_array ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given",
    [[1, 2, 3], (1, 2, 3), np.array([1, 2, 3], np.uint16), torch.tensor([1, 2, 3])],
)
def test_token_array_returns_int64(given: object) -> None:
    arr = token_array(given)

    assert arr.dtype == np.int64
    assert arr.ndim == 1
    assert arr.tolist() == [1, 2, 3]


def test_token_array_accepts_an_empty_list() -> None:
    arr = token_array([])

    assert arr.dtype == np.int64
    assert arr.shape == (0,)


@pytest.mark.parametrize(
    "given", [[1.0, 2.0], np.array([0.5]), torch.tensor([1.0, 2.0]), [True], ["1"]]
)
def test_token_array_refuses_non_integers(given: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        token_array(given, argument="requests[1].token_ids")

    assert info.value.argument == "requests[1].token_ids"
    assert "integers" in str(info.value)


@pytest.mark.parametrize(("given", "shown"), [([1, -1, 2], -1), ([-7, -3], -7)])
def test_token_array_refuses_negative_ids(given: list[int], shown: int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        token_array(given)

    assert info.value.argument == "token_ids"
    assert info.value.value == shown
    assert f"token_ids={shown}" in str(info.value)


@pytest.mark.parametrize("given", [[[1, 2], [3, 4]], np.zeros((1, 3), np.int64), 5])
def test_token_array_refuses_other_shapes(given: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        token_array(given)

    assert info.value.argument == "token_ids"
    assert "1-D" in str(info.value)


def test_token_array_refuses_ragged_nested_lists() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        token_array([[1], [2, 3]])

    assert info.value.argument == "token_ids"


# -- KeySpace ---------------------------------------------------------------------------------


def _space(**changes: object) -> KeySpace:
    args: dict[str, object] = {
        "model": "llama",
        "layout_fingerprint": "0123456789abcdef",
        "chunk_blocks": 4,
        "num_layers": 32,
        "rank": 0,
    }
    args.update(changes)
    return KeySpace.for_layout(**args)  # type: ignore[arg-type]


def test_namespace_is_the_same_for_the_same_inputs() -> None:
    assert _space().namespace == _space().namespace
    assert _space() == _space()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "llama-2"},
        {"layout_fingerprint": "fedcba9876543210"},
        {"chunk_blocks": 8},
        {"num_layers": 31},
    ],
)
def test_namespace_differs_by_model_fingerprint_chunk_blocks_and_layers(
    change: dict[str, object],
) -> None:
    assert _space(**change).namespace != _space().namespace


def test_namespace_does_not_depend_on_rank_but_keys_do() -> None:
    hashes = chunk_hashes(_tokens(32), 16)
    r0, r3 = _space(rank=0), _space(rank=3)

    assert r0.namespace == r3.namespace
    k0, k3 = r0.keys(hashes), r3.keys(hashes)
    assert k0 != k3
    assert k3 == [f"{r3.namespace}/3/{h.hex()}" for h in hashes]
    assert k0 == [f"{r0.namespace}/0/{h.hex()}" for h in hashes]


def test_keys_end_with_the_chunk_hash_in_hex() -> None:
    hashes = chunk_hashes(_tokens(48), 16)

    keys = _space(rank=2).keys(hashes)

    assert len(keys) == 3
    for key, h in zip(keys, hashes, strict=True):
        namespace, rank, digest = key.split("/")
        assert namespace == _space().namespace
        assert rank == "2"
        assert bytes.fromhex(digest) == h


def test_keys_of_no_hashes_is_empty() -> None:
    assert _space().keys([]) == []


@pytest.mark.parametrize("model", ["org/model", "a/b/c", "m:x", "with space", "ünï/cödé"])
def test_model_names_are_quoted_so_keys_split_cleanly(model: str) -> None:
    space = _space(model=model)
    (key,) = space.keys([b"\x01" * 16])

    namespace, rank, digest = key.split("/")
    assert namespace == space.namespace
    assert rank == "0"
    assert digest == "01" * 16
    fields = namespace.split(":")
    assert len(fields) == 5
    assert unquote(fields[1]) == model
    assert " " not in namespace


def test_model_names_that_look_quoted_do_not_collide() -> None:
    names = ["a/b", "a%2Fb", "a:b", "a%3Ab", "a_b"]

    namespaces = {_space(model=m).namespace for m in names}

    assert len(namespaces) == len(names)
