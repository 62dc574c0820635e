"""KVLayout: where each layer's KV blocks live in device memory, and how a pool object is laid out.

A layer has one or more *parts* (a whole tensor, or the K or V half of one). A part is three
numbers: the address of block 0, the stride between blocks and the bytes of one block. A block's
bytes must be contiguous inside a part; the blocks themselves may be strided.

A pool object holds one chunk of ``chunk_blocks`` blocks, all layers, laid out
``[layer][part][block in chunk]``: one layer of one chunk is one contiguous range, and inside it
each part's blocks are contiguous too, so consecutive block ids coalesce into one copy per part.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow._validate import int_vector, merge_spans
from kvflow.errors import InvalidArgumentError, LayoutError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_KINDS",
    "KVLayout",
    "KVPart",
    "LAYOUT_FORMAT_VERSION",
    "SKIP_BLOCK",
    "device_kind",
]

LAYOUT_FORMAT_VERSION = 1
SKIP_BLOCK = -1  # a load's block id for a place whose KV the caller holds: nothing is written
# the kinds of device memory kvflow moves bytes for (kvflow.devices has an ordering for each)
DEVICE_KINDS = ("cpu", "npu", "cuda")


def device_kind(device: Any) -> str:
    """``"cpu"``, ``"npu"``, ``"cuda"``...: the type of a torch device or its name."""
    return str(getattr(device, "type", str(device).split(":")[0]))


@dataclass(frozen=True)
class KVPart:
    """One contiguous-per-block piece of a layer's KV: ``base + block_id * block_stride``."""

    base: int
    block_stride: int
    block_bytes: int
    block_shape: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Per-layer KV tensors as parts, plus what the pool needs to know to lay out objects.

    Build one with ``from_tensors`` (``[num_blocks, ...]`` per layer, or a tuple of such
    tensors per layer), ``from_kv_split_tensors`` (``[2, num_blocks, ...]``: K and V are two
    parts) or ``from_mla_tensors`` (``[num_blocks, block_size, dim]``, or with a unit head
    dimension ``[num_blocks, 1, block_size, dim]``). The layout keeps the
    tensors alive while it exists. Immutable and safe to share between threads.
    """

    layers: tuple[tuple[KVPart, ...], ...]
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    kind: str
    _tensors: tuple[Any, ...] = field(default=(), repr=False)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[torch.Tensor | Sequence[torch.Tensor]], *, block_size: int
    ) -> KVLayout:
        """One entry per layer: a ``[num_blocks, ...]`` tensor, or a tuple of them (parts).

        ``block_size`` is taken as given: ``[num_blocks, ...]`` does not say which dimension
        holds the tokens (vllm-ascend's tensors have them second, vLLM's CPU and FlashAttention
        backends' third), or whether one does (a flattened block).
        """
        per_layer = [tuple(t) if isinstance(t, (tuple, list)) else (t,) for t in _listed(tensors)]
        return cls._build(per_layer, block_size=block_size, kind="blocks")

    @classmethod
    def from_kv_split_tensors(cls, tensors: Sequence[torch.Tensor], *, block_size: int) -> KVLayout:
        """One ``[2, num_blocks, ...]`` tensor per layer: K and V become two parts.

        ``block_size`` is taken as given, as in ``from_tensors``: vLLM's ``[2, num_blocks,
        block_size, heads, head_dim]`` shares this form with head-major and flattened blocks.
        """
        per_layer = []
        for i, t in enumerate(_listed(tensors)):
            _check_tensor(t, f"tensors[{i}]")
            if t.dim() < 2 or t.shape[0] != 2:
                raise LayoutError(
                    f"tensors[{i}].shape", tuple(t.shape), "expected [2, num_blocks, ...]"
                )
            per_layer.append((t[0], t[1]))
        return cls._build(per_layer, block_size=block_size, kind="kv_split", keep=tuple(tensors))

    @classmethod
    def from_mla_tensors(cls, tensors: Sequence[torch.Tensor], *, block_size: int) -> KVLayout:
        """One latent tensor per layer (MLA): ``[num_blocks, block_size, dim]`` (vLLM's CUDA
        MLA backends before the generic cache views), or ``[num_blocks, 1, block_size, dim]``
        (vLLM's ``[blocks, heads, tokens, content]`` view of an MLA page: one latent head, as
        its CPU MLA backend hands it over). Both describe the same bytes: a block is
        ``block_size * dim`` contiguous values, shaped ``(block_size, dim)`` either way, so the
        two forms share pool objects.

        The only constructor whose shape places the tokens, so the only one that checks
        ``block_size`` against it: a first tensor whose token dimension differs raises
        LayoutError naming ``block_size``; a later one that differs from it, naming that
        tensor; any other shape, naming the tensor and both forms.
        """
        _check_block_size(block_size)
        per_layer = []
        for i, t in enumerate(_listed(tensors)):
            _check_tensor(t, f"tensors[{i}]")
            latent = _mla_latent(t)
            if i == 0 and latent is not None and latent.shape[1] != block_size:
                raise LayoutError(
                    "block_size",
                    block_size,
                    f"tensors[0].shape={tuple(t.shape)} is {_MLA_FORMS} for MLA: "
                    f"its blocks hold {latent.shape[1]} tokens",
                )
            if latent is None or latent.shape[1] != block_size:
                raise LayoutError(
                    f"tensors[{i}].shape",
                    tuple(t.shape),
                    f"expected {_MLA_FORMS.replace('block_size', f'block_size={block_size}')} "
                    "for MLA",
                )
            per_layer.append((latent,))
        return cls._build(per_layer, block_size=block_size, kind="mla", keep=tuple(tensors))

    @classmethod
    def _build(
        cls,
        per_layer: list[tuple[Any, ...]],
        *,
        block_size: int,
        kind: str,
        keep: tuple[Any, ...] = (),
    ) -> KVLayout:
        _check_block_size(block_size)
        if not per_layer or any(len(parts) == 0 for parts in per_layer):
            raise LayoutError("tensors", per_layer, "need at least one layer with one tensor")
        first = per_layer[0][0]
        _check_tensor(first, "tensors[0]")
        dtype, device = first.dtype, first.device
        layers = []
        num_blocks = None
        for i, parts in enumerate(per_layer):
            described = []
            for j, t in enumerate(parts):
                name = f"tensors[{i}]" if len(parts) == 1 else f"tensors[{i}][{j}]"
                _check_tensor(t, name)
                if t.dtype != dtype:
                    raise LayoutError(f"{name}.dtype", str(t.dtype), f"differs from {dtype}")
                if t.device != device:
                    raise LayoutError(f"{name}.device", str(t.device), f"differs from {device}")
                part = _describe(t, name)
                if num_blocks is None:
                    num_blocks = t.shape[0]
                elif t.shape[0] != num_blocks:
                    raise LayoutError(
                        f"{name}.shape[0]", t.shape[0], f"differs from num_blocks={num_blocks}"
                    )
                described.append(part)
            layers.append(tuple(described))
        assert num_blocks is not None
        if num_blocks < 1:
            raise LayoutError("tensors[0].shape[0]", num_blocks, "need at least one block")
        if device_kind(device) not in DEVICE_KINDS:  # kvflow moves bytes for these only
            raise LayoutError("device", str(device), f"kvflow handles {DEVICE_KINDS}")
        tensors = keep or tuple(t for parts in per_layer for t in parts)
        return cls(
            layers=tuple(layers),
            num_blocks=int(num_blocks),
            block_size=block_size,
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            kind=kind,
            _tensors=tensors,
        )

    # -- derived sizes ----------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_block_bytes(self, layer: int) -> int:
        """Bytes of one block of one layer, all parts."""
        return int(self._layer_bytes[layer])

    @cached_property
    def _layer_bytes(self) -> np.ndarray:
        return np.array([sum(p.block_bytes for p in parts) for parts in self.layers], np.int64)

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers and parts."""
        return int(self._layer_bytes.sum())

    def object_bytes(self, chunk_blocks: int) -> int:
        """Size of one pool object: a chunk of ``chunk_blocks`` blocks, all layers."""
        return chunk_blocks * self.block_bytes

    def layer_offsets(self, chunk_blocks: int) -> np.ndarray:
        """Offset of each layer inside a pool object (int64, length num_layers)."""
        offsets: np.ndarray = self._layer_starts * chunk_blocks
        return offsets

    @cached_property
    def _layer_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self._layer_bytes[:-1])]).astype(np.int64)

    @cached_property
    def part_bases(self) -> tuple[np.ndarray, ...]:
        """Per layer, the base address of each part (int64 arrays)."""
        return tuple(np.array([p.base for p in parts], np.int64) for parts in self.layers)

    @cached_property
    def signatures(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per layer, ``((block_stride, block_bytes), ...)`` of its parts: layers with equal
        signatures share one address template."""
        return tuple(tuple((p.block_stride, p.block_bytes) for p in parts) for parts in self.layers)

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) spans of device memory that copies may touch, merged."""
        spans = sorted(
            (p.base, p.base + (self.num_blocks - 1) * p.block_stride + p.block_bytes)
            for parts in self.layers
            for p in parts
        )
        return [(lo, hi - lo) for lo, hi in merge_spans(spans)]

    def fingerprint(self) -> str:
        """A stable digest of what makes bytes interchangeable: dtype, kind, block size, per
        layer the parts' block shapes, and the format version. Addresses and the number of blocks
        are not part of it, so two processes with the same model share pool objects."""
        desc = {
            "v": LAYOUT_FORMAT_VERSION,
            "dtype": self.dtype,
            "kind": self.kind,
            "block_size": self.block_size,
            "layers": [[list(p.block_shape) for p in parts] for parts in self.layers],
        }
        blob = json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # -- validation of operation arguments ----------------------------------------------------

    def check_layer(self, layer: int, *, argument: str = "layer") -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InvalidArgumentError(argument, layer, "must be an integer layer index")
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(
                argument, layer, f"out of range: the layout has {self.num_layers} layers"
            )
        return int(layer)

    def check_block_ids(
        self, block_ids: Any, *, argument: str = "block_ids", skip: bool = False
    ) -> np.ndarray:
        """Block ids as an int64 array; refuses non-integers and ids outside [0, num_blocks),
        but for ``SKIP_BLOCK`` where ``skip`` (a load) allows it."""
        arr = int_vector(block_ids, argument, "block ids")
        bad = (arr < 0) | (arr >= self.num_blocks)
        if skip:
            bad &= arr != SKIP_BLOCK
        if arr.size and bad.any():
            allowed = f"[0, {self.num_blocks})" + (f" or SKIP_BLOCK ({SKIP_BLOCK})" if skip else "")
            raise InvalidArgumentError(
                argument, int(arr[bad][0]), f"block id out of range: expected {allowed}"
            )
        return arr

    def __repr__(self) -> str:
        parts = {len(p) for p in self.layers}
        return (
            f"KVLayout(kind={self.kind!r}, layers={self.num_layers}, parts={sorted(parts)}, "
            f"num_blocks={self.num_blocks}, block_size={self.block_size}, dtype={self.dtype}, "
            f"device={self.device}, block_bytes={self.block_bytes})"
        )


def _check_block_size(block_size: Any) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise LayoutError("block_size", block_size, "must be an integer >= 1")


def _listed(tensors: Any) -> list[Any]:
    if tensors is None or isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__len__"):
        raise LayoutError("tensors", tensors, "expected a sequence with one entry per layer")
    if hasattr(tensors, "dim"):
        raise LayoutError("tensors", "a single tensor", "expected a sequence of per-layer tensors")
    if len(tensors) == 0:
        raise LayoutError("tensors", [], "need at least one layer")
    return list(tensors)


def _check_tensor(t: Any, name: str) -> None:
    if not (hasattr(t, "data_ptr") and hasattr(t, "stride") and hasattr(t, "dtype")):
        raise LayoutError(name, type(t).__name__, "expected a torch.Tensor")
    if t.dim() < 2:
        raise LayoutError(
            f"{name}.shape", tuple(t.shape), "expected [num_blocks, ...] (2-D or more)"
        )


_MLA_FORMS = "[num_blocks, block_size, dim] or [num_blocks, 1, block_size, dim]"


def _mla_latent(t: torch.Tensor) -> torch.Tensor | None:
    """An MLA cache tensor as a ``[num_blocks, block_size, dim]`` view of the same memory; None
    for a shape that is neither of ``_MLA_FORMS``."""
    if t.dim() == 3:
        return t
    if t.dim() == 4 and t.shape[1] == 1:
        return t.squeeze(1)
    return None


def _describe(t: torch.Tensor, name: str) -> KVPart:
    """Describe a ``[num_blocks, ...]`` tensor whose per-block bytes are contiguous."""
    item = t.element_size()
    inner = tuple(int(s) for s in t.shape[1:])
    expected = []
    acc = 1
    for size in reversed(inner):
        expected.append(acc)
        acc *= size
    expected.reverse()
    actual = [int(s) for d, s in enumerate(t.stride()[1:]) if inner[d] != 1]
    wanted = [s for d, s in enumerate(expected) if inner[d] != 1]
    if actual != wanted:
        raise LayoutError(
            f"{name}.stride()", tuple(t.stride()), "each block's elements must be contiguous"
        )
    block_bytes = math.prod(inner) * item
    stride = int(t.stride()[0]) * item
    if t.shape[0] > 1 and stride < block_bytes:
        raise LayoutError(f"{name}.stride()", tuple(t.stride()), "blocks overlap in memory")
    if block_bytes == 0:
        raise LayoutError(f"{name}.shape", tuple(t.shape), "a block holds no bytes")
    return KVPart(
        base=int(t.data_ptr()), block_stride=stride, block_bytes=block_bytes, block_shape=inner
    )
