"""vLLM's per-layer KV cache tensors as a KVLayout, and the spec fingerprint, without vLLM.

What is tested: ``cache_layout`` on each tensor shape vLLM hands a connector (the CPU backend's
``[num_blocks, heads, block_size, 2 * head_size]``, FlashAttention's ``[num_blocks, 2,
block_size, heads, head_size]``, the other CUDA backends' ``[2, num_blocks, ...]`` and MLA's
``[num_blocks, block_size, latent_dim]`` or ``[num_blocks, 1, block_size, latent_dim]``, checked
against the shape vLLM's cache spec gives): layer names in order, layer count, parts per layer,
bytes of one block, and that each part addresses the right memory; wrong shapes are refused
naming the layer. ``spec_fingerprint``: equal specs give equal digests (also in another
process), any differing field a different one.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvflow import LayoutError
from kvflow.integrations.vllm.caches import cache_layout, spec_fingerprint, vllm_cache_shape
from tests.support.vllm_planning import FullAttentionSpec, MLAAttentionSpec

NUM_BLOCKS = 6
BLOCK_SIZE = 4
HEADS = 2
HEAD_SIZE = 8
LATENT = 24
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.attn"]

# -- helpers ----------------------------------------------------------------------------------


def cpu_backend(dtype: torch.dtype = torch.float32, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """The CPU backend's ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``."""
    return torch.zeros(num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=dtype)


def flash_attn(dtype: torch.dtype = torch.float32, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """FlashAttention's ``[num_blocks, 2, block_size, num_kv_heads, head_size]``."""
    return torch.zeros(num_blocks, 2, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=dtype)


def kv_split(dtype: torch.dtype = torch.float32, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """The other CUDA backends' ``[2, num_blocks, block_size, num_kv_heads, head_size]``."""
    return torch.zeros(2, num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=dtype)


def mla(dtype: torch.dtype = torch.float32, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """MLA's ``[num_blocks, block_size, latent_dim]``."""
    return torch.zeros(num_blocks, BLOCK_SIZE, LATENT, dtype=dtype)


def caches(make: Callable[..., torch.Tensor], **kwargs: Any) -> dict[str, torch.Tensor]:
    """One tensor per layer of NAMES, in that order."""
    return {name: make(**kwargs) for name in NAMES}


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return int(t.numel() * t.element_size())


# -- cache_layout -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make", [cpu_backend, flash_attn], ids=["cpu", "flash_attn"])
def test_blocks_first_tensors_are_one_part_per_layer(
    make: Callable[..., torch.Tensor], dtype: torch.dtype
) -> None:
    kv = caches(make, dtype=dtype)

    names, layout = cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)

    assert names == NAMES
    assert layout.num_layers == len(NAMES)
    assert layout.num_blocks == NUM_BLOCKS
    assert layout.block_size == BLOCK_SIZE
    assert layout.dtype == str(dtype).removeprefix("torch.")
    for i, name in enumerate(NAMES):
        t = kv[name]
        (part,) = layout.layers[i]
        assert layout.layer_block_bytes(i) == nbytes(t[0])  # K and V of one block, one layer
        for b in range(NUM_BLOCKS):
            assert part.base + b * part.block_stride == t[b].data_ptr()
    assert layout.block_bytes == len(NAMES) * nbytes(kv[NAMES[0]][0])
    assert layout.layer_block_bytes(0) == 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_split_tensors_are_two_parts_per_layer(dtype: torch.dtype) -> None:
    kv = caches(kv_split, dtype=dtype)

    names, layout = cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)

    assert names == NAMES
    assert layout.num_layers == len(NAMES)
    assert layout.num_blocks == NUM_BLOCKS
    assert layout.kind == "kv_split"
    for i, name in enumerate(NAMES):
        t = kv[name]
        k, v = layout.layers[i]
        assert k.block_bytes == v.block_bytes == nbytes(t[0, 0])
        assert layout.layer_block_bytes(i) == nbytes(t[:, 0])  # both halves of one block
        for b in range(NUM_BLOCKS):
            assert k.base + b * k.block_stride == t[0, b].data_ptr()
            assert v.base + b * v.block_stride == t[1, b].data_ptr()
    assert layout.layer_block_bytes(0) == 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * dtype.itemsize


def test_mla_tensors_are_one_latent_part_per_layer() -> None:
    kv = caches(mla, dtype=torch.float16)

    names, layout = cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, mla=True)

    assert names == NAMES
    assert layout.num_layers == len(NAMES)
    assert layout.kind == "mla"
    for i, name in enumerate(NAMES):
        t = kv[name]
        (part,) = layout.layers[i]
        assert layout.layer_block_bytes(i) == nbytes(t[0]) == BLOCK_SIZE * LATENT * 2
        for b in range(NUM_BLOCKS):
            assert part.base + b * part.block_stride == t[b].data_ptr()


def mla_page_view(dtype: torch.dtype = torch.float32, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """vLLM's ``[blocks, heads, tokens, content]`` view of an MLA page: one latent head (the CPU
    MLA backend's tensors)."""
    return torch.zeros(num_blocks, 1, BLOCK_SIZE, LATENT, dtype=dtype)


def test_mla_in_vllms_page_view_is_one_latent_part_per_layer() -> None:
    kv = caches(mla_page_view, dtype=torch.bfloat16)
    shape = (NUM_BLOCKS, 1, BLOCK_SIZE, LATENT)

    names, layout = cache_layout(
        kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, mla=True, expected_shape=shape
    )

    assert names == NAMES and layout.kind == "mla"
    for i, name in enumerate(NAMES):
        t = kv[name]
        (part,) = layout.layers[i]
        assert layout.layer_block_bytes(i) == nbytes(t[0]) == BLOCK_SIZE * LATENT * 2
        for b in range(NUM_BLOCKS):
            assert part.base + b * part.block_stride == t[b].data_ptr()


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (mla_page_view, (NUM_BLOCKS, BLOCK_SIZE, LATENT)),
        (mla, (NUM_BLOCKS, 1, BLOCK_SIZE, LATENT)),
        (mla_page_view, (NUM_BLOCKS, 1, BLOCK_SIZE, 2 * LATENT)),
    ],
    ids=["page-view-not-expected", "3d-not-expected", "other-latent"],
)
def test_a_tensor_unlike_vllms_cache_spec_is_refused_naming_layer_and_shapes(
    make: Callable[..., torch.Tensor], shape: tuple[int, ...]
) -> None:
    kv = caches(make)

    with pytest.raises(LayoutError) as info:
        cache_layout(
            kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, mla=True, expected_shape=shape
        )

    assert info.value.argument == f"kv_caches[{NAMES[0]!r}].shape"
    assert info.value.value == tuple(kv[NAMES[0]].shape)
    assert str(shape) in str(info.value)


def test_an_mla_layer_of_neither_form_is_refused_naming_it_and_both_forms() -> None:
    kv = caches(mla_page_view)
    kv[NAMES[2]] = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, LATENT)  # two heads: not MLA's page

    with pytest.raises(LayoutError) as info:
        cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, mla=True)

    assert info.value.argument == f"kv_caches[{NAMES[2]!r}].shape"
    assert "[num_blocks, 1, block_size=4, dim]" in str(info.value)


def test_where_backends_shape_their_caches_the_chosen_backend_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM without the generic page views (``vllm.v1.kv_cache_interface`` lacks them):
    ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)`` of the backend,
    MLA's ``[num_blocks, block_size, head_size]``, which ``cache_layout`` then reads."""
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_cache_interface", None)  # import fails

    class MLABackend:
        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
        ) -> tuple[int, ...]:
            return (num_blocks, block_size, head_size)

    spec = types.SimpleNamespace(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=LATENT, dtype=torch.float16
    )

    shape = vllm_cache_shape(spec, NUM_BLOCKS, MLABackend)

    assert shape == (NUM_BLOCKS, BLOCK_SIZE, LATENT)
    assert vllm_cache_shape(spec, NUM_BLOCKS, None) is None  # nothing to ask: no check
    _, layout = cache_layout(
        caches(mla), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, mla=True, expected_shape=shape
    )
    assert layout.layer_block_bytes(0) == BLOCK_SIZE * LATENT * 4


def test_layer_names_keep_the_dicts_order() -> None:
    order = [NAMES[2], NAMES[0], NAMES[1]]
    kv = {name: cpu_backend() for name in order}

    names, layout = cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)

    assert names == order
    for i, name in enumerate(order):
        assert layout.layers[i][0].base == kv[name].data_ptr()


def test_a_single_layer_is_a_layout() -> None:
    _, layout = cache_layout({"only": flash_attn()}, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)

    assert layout.num_layers == 1


def test_two_blocks_of_flash_attention_are_not_taken_for_kv_split() -> None:
    """``[2, 2, ...]`` with num_blocks=2 is FlashAttention's shape too: read as blocks-first."""
    kv = {name: flash_attn(num_blocks=2) for name in NAMES}

    _, layout = cache_layout(kv, num_blocks=2, block_size=BLOCK_SIZE)

    assert all(len(parts) == 1 for parts in layout.layers)
    assert layout.layer_block_bytes(0) == nbytes(kv[NAMES[0]][0])


def test_no_tensors_is_refused() -> None:
    with pytest.raises(LayoutError):
        cache_layout({}, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


@pytest.mark.parametrize(
    ("make", "wrong", "mla_kind"),
    [
        pytest.param(cpu_backend, cpu_backend(num_blocks=NUM_BLOCKS - 1), False, id="cpu-blocks"),
        pytest.param(flash_attn, torch.zeros(NUM_BLOCKS), False, id="flash_attn-1d"),
        pytest.param(flash_attn, kv_split(), False, id="flash_attn-then-kv_split"),
        pytest.param(kv_split, kv_split(num_blocks=NUM_BLOCKS + 1), False, id="kv_split-blocks"),
        pytest.param(kv_split, flash_attn(), False, id="kv_split-then-flash_attn"),
        pytest.param(mla, torch.zeros(NUM_BLOCKS, BLOCK_SIZE + 1, LATENT), True, id="mla-bs"),
        pytest.param(mla, torch.zeros(NUM_BLOCKS, BLOCK_SIZE * LATENT), True, id="mla-2d"),
    ],
)
def test_a_wrong_shape_names_the_layer(
    make: Callable[..., torch.Tensor], wrong: torch.Tensor, mla_kind: bool
) -> None:
    kv = caches(make)
    kv[NAMES[1]] = wrong

    with pytest.raises(LayoutError) as info:
        cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, mla=mla_kind)

    assert NAMES[1] in str(info.value)


@pytest.mark.parametrize(
    "wrong",
    [cpu_backend(num_blocks=NUM_BLOCKS + 2), kv_split(num_blocks=NUM_BLOCKS - 1)],
    ids=["blocks", "kv_split"],
)
def test_a_first_layer_with_the_wrong_block_count_names_it(wrong: torch.Tensor) -> None:
    kv = caches(cpu_backend)
    kv[NAMES[0]] = wrong

    with pytest.raises(LayoutError) as info:
        cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)

    assert NAMES[0] in str(info.value)


# -- spec_fingerprint -------------------------------------------------------------------------


def fingerprint(spec: Any = None, *, num_layers: int = 32, tp_size: int = 1) -> str:
    """``spec_fingerprint`` of ``spec`` (default: the stand-in full attention spec)."""
    return spec_fingerprint(spec or FullAttentionSpec(), num_layers=num_layers, tp_size=tp_size)


def test_equal_specs_give_equal_digests() -> None:
    a = fingerprint(FullAttentionSpec())
    b = fingerprint(FullAttentionSpec())

    assert a == b
    assert isinstance(a, str) and a
    int(a, 16)  # a hex digest


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 32},
        {"num_kv_heads": 4},
        {"head_size": 64},
        {"dtype": torch.float16},
        {"dtype": torch.float8_e4m3fn},
        {"page_size_bytes": 2 * 16 * 8 * 128},
    ],
    ids=lambda c: next(iter(c)) + "=" + str(next(iter(c.values()))),
)
def test_any_differing_spec_field_gives_another_digest(change: dict[str, Any]) -> None:
    base = FullAttentionSpec()

    assert fingerprint(dataclasses.replace(base, **change)) != fingerprint(base)


def test_layers_tp_size_and_spec_kind_change_the_digest() -> None:
    base = fingerprint()

    assert fingerprint(num_layers=31) != base
    assert fingerprint(tp_size=2) != base
    assert fingerprint(MLAAttentionSpec()) != base
    assert len({base, fingerprint(num_layers=31), fingerprint(tp_size=2)}) == 3


def test_the_digest_is_the_same_in_another_process() -> None:
    """The scheduler and the workers are separate processes: the digest may not depend on
    anything per-process (str hashing, addresses)."""
    script = (
        "import dataclasses, torch\n"
        "from kvflow.integrations.vllm.caches import spec_fingerprint\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class FullAttentionSpec:\n"
        "    block_size: int = 16\n"
        "    num_kv_heads: int = 8\n"
        "    head_size: int = 128\n"
        "    dtype: object = torch.bfloat16\n"
        f"    page_size_bytes: int = {FullAttentionSpec().page_size_bytes}\n"
        "print(spec_fingerprint(FullAttentionSpec(), num_layers=32, tp_size=1))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}

    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )

    assert out.stdout.strip() == fingerprint()


def ascend_pair(dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm-ascend's per-layer (key_cache, value_cache), each [blocks, block_size, heads, dim]
    (NPU tensors there; the layout code is device-independent)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def test_key_and_value_tensors_of_a_layer_are_its_two_parts() -> None:
    kv = {name: ascend_pair() for name in NAMES}

    names, layout = cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)

    assert names == NAMES and layout.num_layers == len(NAMES) and layout.kind == "blocks"
    for i, name in enumerate(NAMES):
        k, v = layout.layers[i]
        for part, t in ((k, kv[name][0]), (v, kv[name][1])):
            assert part.block_bytes == nbytes(t[0])
            assert all(part.base + b * part.block_stride == t[b].data_ptr() for b in range(6))
    assert layout.layer_block_bytes(0) == 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * 2


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ((), ""),
        ((torch.zeros(NUM_BLOCKS + 1, 4), torch.zeros(NUM_BLOCKS, 4)), "[0].shape"),
        ((torch.zeros(NUM_BLOCKS, 4), "v"), "[1].shape"),
    ],
)
def test_a_bad_tuple_names_the_layer_and_tensor(value: Any, where: str) -> None:
    kv: dict[str, Any] = {name: ascend_pair() for name in NAMES}
    kv[NAMES[1]] = value
    with pytest.raises(LayoutError) as err:
        cache_layout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    assert err.value.argument.startswith(f"kv_caches[{NAMES[1]!r}]")
    assert err.value.argument.endswith(where.removeprefix(f"kv_caches[{NAMES[1]!r}]"))
