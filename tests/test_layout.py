"""KVLayout: describing per-layer KV tensors as parts, refusing what it cannot describe."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvflow import InvalidArgumentError, KVLayout, LayoutError
from kvflow.layout import KVPart

# -- construction: contiguous tensors ---------------------------------------------------------


def test_from_tensors_describes_contiguous_tensors_one_part_per_layer() -> None:
    tensors = [torch.zeros(8, 2, 4, 16, dtype=torch.float16) for _ in range(3)]

    layout = KVLayout.from_tensors(tensors, block_size=4)

    assert layout.num_layers == 3
    assert layout.num_blocks == 8
    assert layout.block_size == 4
    assert layout.dtype == "float16"
    assert layout.device == "cpu"
    assert layout.kind == "blocks"
    for t, parts in zip(tensors, layout.layers, strict=True):
        assert parts == (
            KVPart(base=t.data_ptr(), block_stride=256, block_bytes=256, block_shape=(2, 4, 16)),
        )
    assert layout.layer_block_bytes(0) == 256
    assert layout.block_bytes == 3 * 256


def test_from_tensors_accepts_a_tuple_of_parts_per_layer() -> None:
    k = torch.zeros(6, 4, 8, dtype=torch.float32)
    v = torch.zeros(6, 4, 2, dtype=torch.float32)

    layout = KVLayout.from_tensors([(k, v), [k, v]], block_size=4)

    assert layout.num_layers == 2
    for parts in layout.layers:
        assert parts == (
            KVPart(base=k.data_ptr(), block_stride=128, block_bytes=128, block_shape=(4, 8)),
            KVPart(base=v.data_ptr(), block_stride=32, block_bytes=32, block_shape=(4, 2)),
        )
    assert layout.layer_block_bytes(1) == 160


def test_from_kv_split_tensors_makes_k_and_v_two_parts() -> None:
    tensors = [torch.zeros(2, 8, 4, 16, dtype=torch.float16) for _ in range(2)]

    layout = KVLayout.from_kv_split_tensors(tensors, block_size=4)

    assert layout.kind == "kv_split"
    assert layout.num_blocks == 8
    block_bytes = 4 * 16 * 2
    for t, parts in zip(tensors, layout.layers, strict=True):
        assert parts == (
            KVPart(t.data_ptr(), block_bytes, block_bytes, (4, 16)),
            KVPart(t.data_ptr() + 8 * block_bytes, block_bytes, block_bytes, (4, 16)),
        )
    assert layout.block_bytes == 2 * 2 * block_bytes


def test_from_mla_tensors_describes_latent_tensors() -> None:
    tensors = [torch.zeros(5, 16, 64, dtype=torch.bfloat16) for _ in range(4)]

    layout = KVLayout.from_mla_tensors(tensors, block_size=16)

    assert layout.kind == "mla"
    assert layout.dtype == "bfloat16"
    assert layout.num_blocks == 5
    for t, parts in zip(tensors, layout.layers, strict=True):
        assert parts == (KVPart(t.data_ptr(), 16 * 64 * 2, 16 * 64 * 2, (16, 64)),)


def test_from_mla_tensors_takes_vllms_one_head_view_as_the_same_blocks() -> None:
    """vLLM's generic cache view of an MLA page, ``[blocks, heads=1, tokens, latent]`` (its CPU
    MLA backend's tensors): the same block bytes, block shape and fingerprint as the 3-D form,
    so either form loads what the other saved."""
    four = [torch.zeros(5, 1, 16, 64, dtype=torch.bfloat16) for _ in range(2)]
    three = [torch.zeros(5, 16, 64, dtype=torch.bfloat16) for _ in range(2)]

    layout = KVLayout.from_mla_tensors(four, block_size=16)

    assert layout.kind == "mla" and layout.num_blocks == 5
    for t, parts in zip(four, layout.layers, strict=True):
        assert parts == (KVPart(t.data_ptr(), 16 * 64 * 2, 16 * 64 * 2, (16, 64)),)
    assert layout.fingerprint() == KVLayout.from_mla_tensors(three, block_size=16).fingerprint()


def test_from_mla_tensors_follows_a_block_stride_wider_than_the_block() -> None:
    """vLLM's block-outermost layouts put other layers' pages between one layer's blocks."""
    backing = torch.zeros(5, 3, 1, 16, 64)  # [blocks, layers, heads, tokens, latent]
    tensors = [backing[:, layer] for layer in range(3)]

    layout = KVLayout.from_mla_tensors(tensors, block_size=16)

    for layer, parts in enumerate(layout.layers):
        (part,) = parts
        assert part.block_stride == 3 * 16 * 64 * 4
        assert part.block_bytes == 16 * 64 * 4
        assert all(
            part.base + b * part.block_stride == backing[b, layer].data_ptr() for b in range(5)
        )


# -- construction: strided but block-contiguous -----------------------------------------------


def test_from_tensors_describes_every_other_block_of_a_bigger_tensor() -> None:
    big = torch.zeros(16, 4, 8, dtype=torch.float32)
    evens, odds = big[::2], big[1::2]

    layout = KVLayout.from_tensors([evens, odds], block_size=4)

    assert layout.num_blocks == 8
    assert layout.layers[0] == (KVPart(big.data_ptr(), 256, 128, (4, 8)),)
    assert layout.layers[1] == (KVPart(big.data_ptr() + 128, 256, 128, (4, 8)),)


def test_views_of_one_buffer_with_layer_outermost_like_vllm_cpu_cache() -> None:
    num_layers, num_blocks, block_size, heads, dim = 3, 10, 4, 2, 8
    buf = torch.zeros(num_layers, 2, num_blocks, block_size, heads, dim, dtype=torch.float16)
    block_bytes = block_size * heads * dim * 2

    layout = KVLayout.from_kv_split_tensors([buf[i] for i in range(num_layers)], block_size=4)

    for i, parts in enumerate(layout.layers):
        k_base = buf.data_ptr() + (2 * i) * num_blocks * block_bytes
        assert parts == (
            KVPart(k_base, block_bytes, block_bytes, (block_size, heads, dim)),
            KVPart(k_base + num_blocks * block_bytes, block_bytes, block_bytes, (4, 2, 8)),
        )
    assert layout.regions() == [(buf.data_ptr(), buf.numel() * buf.element_size())]


def test_views_of_one_buffer_with_block_outermost_are_strided_parts() -> None:
    num_blocks, num_layers = 6, 3
    buf = torch.zeros(num_blocks, num_layers, 2, 4, 8, dtype=torch.float32)
    block_bytes = 4 * 8 * 4
    # [num_blocks, L, 2, ...] -> per layer a [2, num_blocks, ...] view, K/V interleaved per block
    views = [buf[:, i].transpose(0, 1) for i in range(num_layers)]

    layout = KVLayout.from_kv_split_tensors(views, block_size=4)

    stride = num_layers * 2 * block_bytes
    for i, parts in enumerate(layout.layers):
        base = buf.data_ptr() + i * 2 * block_bytes
        assert parts == (
            KVPart(base, stride, block_bytes, (4, 8)),
            KVPart(base + block_bytes, stride, block_bytes, (4, 8)),
        )
    assert layout.regions() == [(buf.data_ptr(), buf.numel() * 4)]


# -- construction: refusals -------------------------------------------------------------------


def test_refuses_a_transposed_inner_dimension() -> None:
    t = torch.zeros(8, 16, 4).transpose(1, 2)

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([t], block_size=4)

    assert info.value.argument == "tensors[0].stride()"
    assert info.value.value == (64, 1, 4)
    assert "(64, 1, 4)" in str(info.value)


def test_refuses_a_slice_of_the_inner_dimension() -> None:
    good = torch.zeros(8, 4, 16)
    bad = good[:, :, :8]

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([good, bad], block_size=4)

    assert info.value.argument == "tensors[1].stride()"
    assert "(64, 16, 1)" in str(info.value)


def test_refuses_overlapping_blocks() -> None:
    t = torch.zeros(1, 4, 8).expand(8, 4, 8)

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([t], block_size=4)

    assert info.value.argument == "tensors[0].stride()"
    assert "overlap" in str(info.value)


def test_refuses_mixed_dtypes() -> None:
    tensors = [torch.zeros(8, 4, 8, dtype=torch.float16), torch.zeros(8, 4, 8)]

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors(tensors, block_size=4)

    assert info.value.argument == "tensors[1].dtype"
    assert "torch.float32" in str(info.value)


def test_refuses_mixed_dtypes_between_parts_of_a_layer() -> None:
    k = torch.zeros(8, 4, 8, dtype=torch.float16)
    v = torch.zeros(8, 4, 8, dtype=torch.bfloat16)

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([(k, v)], block_size=4)

    assert info.value.argument == "tensors[0][1].dtype"
    assert "bfloat16" in str(info.value)


def test_refuses_mixed_devices_with_the_other_device_second() -> None:
    tensors = [torch.zeros(8, 4, 8), torch.empty(8, 4, 8, device="meta")]

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors(tensors, block_size=4)

    assert info.value.argument == "tensors[1].device"
    assert "meta" in str(info.value)


def test_refuses_mixed_devices_with_the_other_device_first() -> None:
    tensors = [torch.empty(8, 4, 8, device="meta"), torch.zeros(8, 4, 8)]

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors(tensors, block_size=4)

    assert info.value.argument == "tensors[1].device"
    assert "'cpu'" in str(info.value)


def test_refuses_a_device_it_cannot_move_bytes_for() -> None:
    tensors = [torch.empty(8, 4, 8, device="meta") for _ in range(2)]

    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors(tensors, block_size=4)

    assert info.value.argument == "device"
    assert "meta" in str(info.value)


@pytest.mark.parametrize(
    "build",
    [KVLayout.from_tensors, KVLayout.from_kv_split_tensors, KVLayout.from_mla_tensors],
)
def test_refuses_an_empty_list(build: object) -> None:
    with pytest.raises(LayoutError) as info:
        build([], block_size=4)  # type: ignore[operator]

    assert info.value.argument == "tensors"
    assert "tensors=[]" in str(info.value)


@pytest.mark.parametrize(
    "build",
    [KVLayout.from_tensors, KVLayout.from_kv_split_tensors, KVLayout.from_mla_tensors],
)
def test_refuses_a_single_tensor_instead_of_a_list(build: object) -> None:
    with pytest.raises(LayoutError) as info:
        build(torch.zeros(2, 4, 4, 8), block_size=4)  # type: ignore[operator]

    assert info.value.argument == "tensors"
    assert "single tensor" in str(info.value)


@pytest.mark.parametrize("value", [None, 3, "layers", b"layers"])
def test_refuses_a_non_sequence(value: object) -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors(value, block_size=4)  # type: ignore[arg-type]

    assert info.value.argument == "tensors"
    assert repr(value) in str(info.value)


def test_refuses_one_dimensional_tensors() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([torch.zeros(8)], block_size=4)

    assert info.value.argument == "tensors[0].shape"
    assert "(8,)" in str(info.value)


def test_refuses_kv_split_tensors_without_a_leading_two() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_kv_split_tensors([torch.zeros(3, 8, 4, 8)], block_size=4)

    assert info.value.argument == "tensors[0].shape"
    assert "(3, 8, 4, 8)" in str(info.value)


@pytest.mark.parametrize("block_size", [8, 32, 1])
def test_mla_refuses_a_block_size_its_tensors_contradict(block_size: int) -> None:
    tensors = [torch.zeros(8, 16, 64), torch.zeros(8, 16, 64)]

    with pytest.raises(LayoutError) as info:
        KVLayout.from_mla_tensors(tensors, block_size=block_size)

    assert info.value.argument == "block_size"
    assert info.value.value == block_size
    assert f"block_size={block_size}:" in str(info.value)
    assert "(8, 16, 64)" in str(info.value)


def test_mla_refuses_a_later_tensor_whose_block_dimension_differs_naming_it() -> None:
    tensors = [torch.zeros(8, 16, 64), torch.zeros(8, 8, 128)]

    with pytest.raises(LayoutError) as info:
        KVLayout.from_mla_tensors(tensors, block_size=16)

    assert info.value.argument == "tensors[1].shape"
    assert info.value.value == (8, 8, 128)
    assert "block_size=16" in str(info.value)


@pytest.mark.parametrize(
    ("build", "shape"),
    [
        (KVLayout.from_tensors, (8, 2, 16, 2, 4)),  # FlashAttention's [blocks, 2, bs, heads, dim]
        (KVLayout.from_tensors, (8, 2, 16, 8)),  # the CPU backend's [blocks, heads, bs, 2*dim]
        (KVLayout.from_kv_split_tensors, (2, 8, 2, 16, 4)),  # [2, blocks, heads, bs, dim] (HND)
        (KVLayout.from_kv_split_tensors, (2, 8, 16 * 2 * 4)),  # [2, blocks, bs*heads*dim]
    ],
)
def test_layouts_whose_shape_does_not_place_block_size_take_it_as_given(
    build: object, shape: tuple[int, ...]
) -> None:
    """``[num_blocks, ...]`` and ``[2, num_blocks, ...]`` do not say which dimension, if any,
    holds the tokens: engines differ, so block_size is not checked against the shape."""
    layout = build([torch.zeros(shape)], block_size=16)  # type: ignore[operator]

    assert layout.block_size == 16


@pytest.mark.parametrize(
    "shape",
    [(8, 16, 2, 32), (8, 2, 16, 32), (8, 16 * 32), (8, 1, 1, 16, 32)],
    ids=["tokens-then-heads", "two-heads", "flat", "5-d"],
)
def test_refuses_mla_tensors_of_neither_form(shape: tuple[int, ...]) -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_mla_tensors([torch.zeros(shape)], block_size=16)

    assert info.value.argument == "tensors[0].shape"
    assert info.value.value == shape
    assert "[num_blocks, block_size=16, dim] or [num_blocks, 1, block_size=16, dim]" in str(
        info.value
    )


def test_mla_refuses_a_four_dimensional_block_size_its_tensors_contradict() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_mla_tensors([torch.zeros(8, 1, 16, 64)], block_size=32)

    assert info.value.argument == "block_size"
    assert "its blocks hold 16 tokens" in str(info.value)


def test_refuses_mismatched_num_blocks_between_layers() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([torch.zeros(8, 4), torch.zeros(9, 4)], block_size=4)

    assert info.value.argument == "tensors[1].shape[0]"
    assert info.value.value == 9
    assert "tensors[1].shape[0]=9" in str(info.value)


def test_refuses_mismatched_num_blocks_between_parts() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([(torch.zeros(8, 4), torch.zeros(7, 4))], block_size=4)

    assert info.value.argument == "tensors[0][1].shape[0]"
    assert info.value.value == 7


def test_refuses_zero_blocks() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([torch.zeros(0, 4)], block_size=4)

    assert info.value.argument == "tensors[0].shape[0]"
    assert info.value.value == 0


@pytest.mark.parametrize("block_size", [0, -1, True, 1.5, "16"])
@pytest.mark.parametrize("build", [KVLayout.from_tensors, KVLayout.from_kv_split_tensors])
def test_refuses_a_bad_block_size(build: object, block_size: object) -> None:
    with pytest.raises(LayoutError) as info:
        build([torch.zeros(2, 8, 4, 8)], block_size=block_size)  # type: ignore[operator]

    assert info.value.argument == "block_size"
    assert f"block_size={block_size!r}" in str(info.value)


@pytest.mark.parametrize("block_size", [0, -1])
def test_mla_refuses_a_bad_block_size_naming_block_size(block_size: int) -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_mla_tensors([torch.zeros(8, 16, 64)], block_size=block_size)

    assert info.value.argument == "block_size"


@pytest.mark.parametrize(
    ("entry", "shown"), [("k", "str"), (np.zeros((8, 4)), "ndarray"), (None, "NoneType")]
)
def test_refuses_non_tensor_entries(entry: object, shown: str) -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([torch.zeros(8, 4), entry], block_size=4)

    assert info.value.argument == "tensors[1]"
    assert info.value.value == shown
    assert shown in str(info.value)


def test_refuses_non_tensor_parts() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([(torch.zeros(8, 4), [1, 2])], block_size=4)

    assert info.value.argument == "tensors[0][1]"


@pytest.mark.parametrize("build", [KVLayout.from_kv_split_tensors, KVLayout.from_mla_tensors])
def test_split_and_mla_refuse_non_tensor_entries(build: object) -> None:
    with pytest.raises(LayoutError) as info:
        build([np.zeros((2, 8, 16, 4))], block_size=16)  # type: ignore[operator]

    assert info.value.argument == "tensors[0]"
    assert "ndarray" in str(info.value)


def test_refuses_a_layer_with_no_parts() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([torch.zeros(8, 4), ()], block_size=4)

    assert info.value.argument == "tensors"


def test_layout_errors_are_invalid_argument_and_value_errors() -> None:
    with pytest.raises(LayoutError) as info:
        KVLayout.from_tensors([], block_size=4)

    assert isinstance(info.value, InvalidArgumentError)
    assert isinstance(info.value, ValueError)


# -- fingerprint ------------------------------------------------------------------------------


def _blocks(
    num_layers: int = 2,
    num_blocks: int = 8,
    shape: tuple[int, ...] = (4, 8),
    dtype: torch.dtype = torch.float16,
) -> list[torch.Tensor]:
    return [torch.zeros(num_blocks, *shape, dtype=dtype) for _ in range(num_layers)]


def test_fingerprint_is_equal_for_different_tensors_of_the_same_shape_and_dtype() -> None:
    a = KVLayout.from_tensors(_blocks(num_blocks=8), block_size=4)
    b = KVLayout.from_tensors(_blocks(num_blocks=8), block_size=4)
    c = KVLayout.from_tensors(_blocks(num_blocks=100), block_size=4)
    big = torch.zeros(2, 16, 4, 8, dtype=torch.float16)
    d = KVLayout.from_tensors([big[0, ::2], big[1, 1::2]], block_size=4)

    assert a.layers != b.layers  # different addresses
    assert a.fingerprint() == b.fingerprint() == c.fingerprint() == d.fingerprint()
    assert isinstance(a.fingerprint(), str)
    assert a.fingerprint() == a.fingerprint()


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (lambda: KVLayout.from_tensors(_blocks(dtype=torch.bfloat16), block_size=4), "dtype"),
        (lambda: KVLayout.from_tensors(_blocks(shape=(4, 4, 2)), block_size=4), "block shape"),
        (lambda: KVLayout.from_tensors(_blocks(shape=(8, 4)), block_size=4), "block shape"),
        (lambda: KVLayout.from_tensors(_blocks(num_layers=3), block_size=4), "layer count"),
        (lambda: KVLayout.from_tensors(_blocks(), block_size=8), "block_size"),
        (
            lambda: KVLayout.from_kv_split_tensors(
                [torch.stack([t, t]) for t in _blocks()], block_size=4
            ),
            "kind and parts",
        ),
        (
            lambda: KVLayout.from_tensors([(t, t) for t in _blocks()], block_size=4),
            "parts per layer",
        ),
    ],
)
def test_fingerprint_differs_when_bytes_are_not_interchangeable(other: object, why: str) -> None:
    base = KVLayout.from_tensors(_blocks(), block_size=4)

    assert base.fingerprint() != other().fingerprint(), why  # type: ignore[operator]


def test_fingerprint_differs_by_kind_for_the_same_parts() -> None:
    blocks = KVLayout.from_tensors([torch.zeros(8, 4, 16)], block_size=4)
    mla = KVLayout.from_mla_tensors([torch.zeros(8, 4, 16)], block_size=4)

    assert blocks.layers[0][0].block_shape == mla.layers[0][0].block_shape
    assert blocks.fingerprint() != mla.fingerprint()


# -- regions ----------------------------------------------------------------------------------


def test_regions_of_separate_layers_are_one_span_per_layer() -> None:
    buf = torch.zeros(3, 8, 4, 8, dtype=torch.float32)  # layer 1 is a gap between 0 and 2
    layout = KVLayout.from_tensors([buf[0], buf[2]], block_size=4)
    layer_bytes = 8 * 4 * 8 * 4

    assert layout.regions() == [
        (buf.data_ptr(), layer_bytes),
        (buf.data_ptr() + 2 * layer_bytes, layer_bytes),
    ]


def test_regions_of_adjacent_and_overlapping_parts_are_merged() -> None:
    buf = torch.zeros(16, 4, 8, dtype=torch.float32)
    # evens and odds interleave; layer 2 repeats layer 0
    layout = KVLayout.from_tensors([buf[::2], buf[1::2], buf[::2]], block_size=4)

    assert layout.regions() == [(buf.data_ptr(), 16 * 128)]


def test_regions_cover_every_block_of_every_part() -> None:
    buf = torch.zeros(40, 4, 8, dtype=torch.float16)
    layout = KVLayout.from_tensors([(buf[0:10:3], buf[20:40:5]), buf[1:14:4]], block_size=4)

    covered: set[int] = set()
    for lo, n in layout.regions():
        covered.update(range(lo, lo + n))
    for parts in layout.layers:
        for p in parts:
            for b in range(layout.num_blocks):
                start = p.base + b * p.block_stride
                assert start in covered
                assert start + p.block_bytes - 1 in covered
    spans = layout.regions()
    assert spans == sorted(spans)
    assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(spans))  # merged, not touching
    # the last block of buf[20:40:5] is block 35: the span ends there, not at the buffer's end
    assert spans[-1] == (buf.data_ptr() + 20 * 64, 15 * 64 + 64)


# -- sizes ------------------------------------------------------------------------------------


def test_layer_offsets_and_object_bytes() -> None:
    layout = KVLayout.from_tensors(
        [torch.zeros(8, 4), (torch.zeros(8, 2), torch.zeros(8, 6)), torch.zeros(8, 1)],
        block_size=4,
    )

    assert [layout.layer_block_bytes(i) for i in range(3)] == [16, 32, 4]
    assert layout.block_bytes == 52
    assert layout.object_bytes(1) == 52
    assert layout.object_bytes(3) == 156
    offsets = layout.layer_offsets(3)
    assert offsets.dtype == np.int64
    assert offsets.tolist() == [0, 48, 144]
    assert layout.layer_offsets(1).tolist() == [0, 16, 48]


def test_layer_offsets_of_a_single_layer() -> None:
    layout = KVLayout.from_tensors([torch.zeros(8, 4)], block_size=4)

    offsets = layout.layer_offsets(4)
    assert offsets.dtype == np.int64
    assert offsets.tolist() == [0]
    assert layout.object_bytes(4) == 64


def test_repr_names_the_shape_of_the_layout() -> None:
    layout = KVLayout.from_kv_split_tensors([torch.zeros(2, 8, 4, 8)] * 3, block_size=4)

    text = repr(layout)
    assert "kind='kv_split'" in text
    assert "layers=3" in text
    assert "parts=[2]" in text
    assert "num_blocks=8" in text


# -- argument checks --------------------------------------------------------------------------


@pytest.fixture
def small_layout() -> KVLayout:
    return KVLayout.from_tensors([torch.zeros(10, 4), torch.zeros(10, 4)], block_size=4)


@pytest.mark.parametrize(
    "ids", [[0, 9, 3], np.array([1, 2], np.int32), np.array([5], np.uint8), torch.tensor([4, 0])]
)
def test_check_block_ids_accepts_integer_sequences(small_layout: KVLayout, ids: object) -> None:
    arr = small_layout.check_block_ids(ids)

    assert arr.dtype == np.int64
    assert arr.tolist() == list(np.asarray(ids).tolist())


def test_check_block_ids_accepts_an_empty_list(small_layout: KVLayout) -> None:
    arr = small_layout.check_block_ids([])

    assert arr.dtype == np.int64
    assert arr.shape == (0,)


@pytest.mark.parametrize(
    ("ids", "bad"), [([0, 10], 10), ([-1, 2], -1), ([3, 100, -5], 100), ([2**40], 2**40)]
)
def test_check_block_ids_refuses_out_of_range_ids(
    small_layout: KVLayout, ids: list[int], bad: int
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        small_layout.check_block_ids(ids, argument="requests[2].block_ids")

    assert info.value.argument == "requests[2].block_ids"
    assert info.value.value == bad
    assert "[0, 10)" in str(info.value)


@pytest.mark.parametrize(
    "ids",
    [
        [1.0, 2.0],
        np.array([1.5]),
        torch.tensor([1.0]),
        [True, False],
        ["1"],
        [1, None],
    ],
)
def test_check_block_ids_refuses_non_integers(small_layout: KVLayout, ids: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        small_layout.check_block_ids(ids)

    assert info.value.argument == "block_ids"
    assert "integers" in str(info.value)


@pytest.mark.parametrize("ids", [[[1, 2], [3, 4]], np.zeros((2, 2), np.int64), 3])
def test_check_block_ids_refuses_other_shapes(small_layout: KVLayout, ids: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        small_layout.check_block_ids(ids)

    assert info.value.argument == "block_ids"
    assert "1-D" in str(info.value)


def test_check_block_ids_refuses_ragged_nested_lists(small_layout: KVLayout) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        small_layout.check_block_ids([[1], [2, 3]])

    assert info.value.argument == "block_ids"


@pytest.mark.parametrize("layer", [0, 1, np.int64(1), np.int32(0)])
def test_check_layer_accepts_layer_indices(small_layout: KVLayout, layer: int) -> None:
    assert small_layout.check_layer(layer) == int(layer)
    assert type(small_layout.check_layer(layer)) is int


@pytest.mark.parametrize("layer", [2, -1, 100])
def test_check_layer_refuses_out_of_range(small_layout: KVLayout, layer: int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        small_layout.check_layer(layer, argument="layer_index")

    assert info.value.argument == "layer_index"
    assert info.value.value == layer
    assert "2 layers" in str(info.value)


@pytest.mark.parametrize("layer", [1.0, True, "0", None, [0]])
def test_check_layer_refuses_non_integers(small_layout: KVLayout, layer: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        small_layout.check_layer(layer)  # type: ignore[arg-type]

    assert info.value.argument == "layer"
    assert f"layer={layer!r}" in str(info.value)
