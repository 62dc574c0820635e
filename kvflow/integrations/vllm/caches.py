"""vLLM's KV cache tensors as a KVLayout, and the keys' namespace both vLLM processes agree on.

vLLM hands the worker one tensor per attention layer (``{layer_name: tensor}``); the block
dimension is found by ``num_blocks``:

* ``[num_blocks, ...]``: the CPU backend's ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]``, FlashAttention's ``[num_blocks, 2, block_size, heads, head_size]``: one part
  per layer;
* MLA (one latent vector per token, ``kv_lora_rank + qk_rope_head_dim`` values): the shape vLLM
  itself gives the layer for its ``MLAAttentionSpec`` (``vllm_cache_shape``), which kvflow
  knows in two forms, ``[num_blocks, 1, block_size, dim]`` (vLLM's ``[blocks, heads, tokens,
  content]`` page view, as its CPU MLA backend hands it over) and ``[num_blocks, block_size,
  dim]`` (backends that shape their own caches); one part per layer;
* ``[2, num_blocks, ...]`` (K and V apart, other CUDA backends): two parts per layer;
* a tuple of ``[num_blocks, ...]`` tensors (vllm-ascend's ``(key_cache, value_cache)`` on NPUs,
  each ``[num_blocks, block_size, num_kv_heads, head_size]``): one part per tensor.

Only ``vllm_cache_shape`` and ``CacheGroup.from_vllm`` import vLLM (when called). The scheduler
has no tensors, so the keys' namespace comes from what both processes know (``CacheGroup``): the
cache spec (block size, heads, head size, dtype, bytes per block), the layer count and the
tensor-parallel size. The worker checks that its tensors have the bytes per block the spec says.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvflow.errors import LayoutError
from kvflow.keys import KeySpace
from kvflow.layout import KVLayout

if TYPE_CHECKING:
    from kvflow.integrations.vllm.config import ConnectorConfig

__all__ = [
    "CacheGroup",
    "cache_layout",
    "group_layout",
    "layer_backend",
    "spec_fingerprint",
    "vllm_cache_shape",
]


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups as both of its processes see it, and the pool objects'
    keys derived from it: a chunk is ``chunk_blocks`` blocks of ``block_size`` tokens, all
    ``num_layers`` layers, one object per tensor-parallel rank (with MLA every rank holds the
    same KV: one object, rank 0's)."""

    spec: Any  # vLLM's KVCacheSpec of the group
    block_size: int
    num_blocks: int
    num_layers: int
    mla: bool
    tp_size: int
    chunk_blocks: int
    model: str  # the model part of every key
    fingerprint: str  # spec_fingerprint
    window: int = 0  # sliding window: tokens whose blocks vLLM keeps behind one (0: full)
    index: int = 0  # the group's place in vLLM's KV cache config
    layer_names: tuple[str, ...] = ()  # the group's layers, as vLLM names them

    @classmethod
    def from_vllm(
        cls, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, index: int = 0
    ) -> CacheGroup:
        """Group ``index`` of vLLM's configs (``support.check_supported`` has accepted them); of
        several groups (vLLM's hybrid KV cache manager), the keys name the group. Imports vLLM."""
        from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec

        groups = len(kv_cache_config.kv_cache_groups)
        group = kv_cache_config.kv_cache_groups[index]
        spec = group.kv_cache_spec
        block_size = int(spec.block_size)
        num_layers = len(group.layer_names)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        model = vllm_config.model_config
        revision = f"@{model.revision}" if getattr(model, "revision", None) else ""
        window = 0  # a FullAttentionSpec's sliding_window: vLLM keeps every block
        if type(spec) is SlidingWindowSpec:  # vLLM keeps the window's blocks, and those retained
            window = spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
        return cls(
            spec=spec,
            block_size=block_size,
            num_blocks=int(kv_cache_config.num_blocks),
            num_layers=num_layers,
            mla=isinstance(spec, MLAAttentionSpec),
            tp_size=tp_size,
            chunk_blocks=config.chunk_blocks_for(block_size),
            model=config.model or f"{model.model}{revision}",
            fingerprint=spec_fingerprint(
                spec,
                num_layers=num_layers,
                tp_size=tp_size,
                group=f"{index}/{groups}" if groups > 1 else "",
            ),
            window=window,
            index=index,
            layer_names=tuple(group.layer_names),
        )

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_blocks * self.block_size

    def keyspace(self, rank: int) -> KeySpace:
        """The keys of ``rank``'s objects."""
        return KeySpace.for_layout(
            model=self.model,
            layout_fingerprint=self.fingerprint,
            chunk_blocks=self.chunk_blocks,
            num_layers=self.num_layers,
            rank=rank,
        )


def cache_layout(
    kv_caches: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]],
    *,
    num_blocks: int,
    block_size: int,
    mla: bool = False,
    expected_shape: tuple[int, ...] | None = None,
) -> tuple[list[str], KVLayout]:
    """The layer names in order and the layout of their tensors.

    ``expected_shape``: the shape vLLM says each layer's tensor has (``vllm_cache_shape``); a
    tensor of another shape is refused naming its layer, the shape and vLLM's.
    """
    names = list(kv_caches)
    if not names:
        raise LayoutError("kv_caches", {}, "vLLM handed over no KV cache tensors")
    if any(isinstance(kv_caches[n], (tuple, list)) for n in names):
        return names, _tuple_layout(kv_caches, names, num_blocks, block_size)
    tensors: list[torch.Tensor] = [kv_caches[n] for n in names]
    if expected_shape is not None:
        for name, t in zip(names, tensors, strict=True):
            if tuple(t.shape) != tuple(expected_shape):
                raise LayoutError(
                    f"kv_caches[{name!r}].shape",
                    tuple(t.shape),
                    f"vLLM's cache spec gives its layers the shape {tuple(expected_shape)}",
                )
    first = tensors[0]
    if mla or (first.dim() >= 2 and first.shape[0] == 2 and first.shape[1] == num_blocks != 2):
        build = KVLayout.from_mla_tensors if mla else KVLayout.from_kv_split_tensors
        try:
            return names, build(tensors, block_size=block_size)
        except LayoutError as exc:  # it numbers the tensors: name the layer instead
            match = re.match(r"tensors\[(\d+)\](.*)", exc.argument)
            if match is None:
                raise
            where = f"kv_caches[{names[int(match[1])]!r}]{match[2]}"
            raise LayoutError(where, exc.value, exc.reason) from None
    for name, t in zip(names, tensors, strict=True):
        if t.dim() < 2 or t.shape[0] != num_blocks:
            raise LayoutError(
                f"kv_caches[{name!r}].shape",
                tuple(t.shape),
                f"expected [{num_blocks}, ...] or [2, {num_blocks}, ...]",
            )
    return names, KVLayout.from_tensors(tensors, block_size=block_size)


def group_layout(
    group: CacheGroup, kv_caches: dict[str, torch.Tensor], vllm_config: Any
) -> tuple[list[str], KVLayout]:
    """The layer names and the layout of a worker's tensors of ``group``, which must hold the
    bytes per block vLLM's cache spec says (and, with MLA, have the shape it gives its layers)."""
    shape = None  # MLA: the shape vLLM's own cache spec gives each layer's tensor
    if group.mla and kv_caches:
        backend = layer_backend(vllm_config, next(iter(kv_caches)))
        shape = vllm_cache_shape(group.spec, group.num_blocks, backend)
    names, layout = cache_layout(
        kv_caches,
        num_blocks=group.num_blocks,
        block_size=group.block_size,
        mla=group.mla,
        expected_shape=shape,
    )
    page = getattr(group.spec, "page_size_bytes", None)
    if page is not None and layout.layer_block_bytes(0) != int(page):
        raise LayoutError(
            "kv_caches",
            f"{layout.layer_block_bytes(0)} bytes per block and layer",
            f"vLLM's cache spec says {page}: kvflow does not know this layout",
        )
    return names, layout


def _tuple_layout(
    kv_caches: Mapping[str, Any], names: list[str], num_blocks: int, block_size: int
) -> KVLayout:
    """Every layer a tuple of ``[num_blocks, ...]`` tensors: each tensor one part."""
    per_layer = []
    for name in names:
        parts = kv_caches[name]
        if not isinstance(parts, (tuple, list)) or not parts:
            raise LayoutError(f"kv_caches[{name!r}]", type(parts).__name__, "expected a tuple")
        for j, t in enumerate(parts):
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] != num_blocks:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise LayoutError(
                    f"kv_caches[{name!r}][{j}].shape", shape, f"expected [{num_blocks}, ...]"
                )
        per_layer.append(tuple(parts))
    return KVLayout.from_tensors(per_layer, block_size=block_size)


def spec_fingerprint(spec: Any, *, num_layers: int, tp_size: int, group: str = "") -> str:
    """A digest of what fixes an object's bytes: the attention spec's kind, block size, heads,
    head size, dtype and bytes per block, the layer count and the tensor-parallel size; and
    ``group`` (``"index/groups"``: which of several KV cache groups, whose layers differ)."""
    parts = [
        type(spec).__name__,
        *(
            str(getattr(spec, name, None))
            for name in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes")
        ),
        f"layers={num_layers}",
        f"tp={tp_size}",
        *([f"group={group}"] if group else []),
    ]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def vllm_cache_shape(spec: Any, num_blocks: int, backend: Any = None) -> tuple[int, ...] | None:
    """The shape vLLM gives each layer's cache tensor for the attention ``spec`` (in
    elements), asked of the installed vLLM: its generic page view ``[num_blocks * pages,
    heads, tokens, content]`` (``compute_layer_kv_cache_shape_bytes``: an MLA page is one
    latent head), or, in a vLLM whose backends shape their caches, the chosen ``backend``'s
    ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)`` (MLA:
    ``[num_blocks, block_size, head_size]``; the stride order changes strides, not the shape).
    None when this vLLM offers neither. Imports vLLM."""
    try:
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
    except ImportError:
        get_shape = getattr(backend, "get_kv_cache_shape", None)
        if get_shape is None:
            return None
        shape = get_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        return tuple(int(s) for s in shape)
    blocks, heads, tokens, content_bytes = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
    item = torch.empty((), dtype=spec.dtype).element_size()
    if content_bytes % item:
        raise LayoutError(
            "spec.dtype",
            str(spec.dtype),
            f"{content_bytes} bytes per head and token are not whole {item}-byte elements",
        )
    return int(blocks), int(heads), int(tokens), int(content_bytes) // item


def layer_backend(vllm_config: Any, layer_name: str) -> Any:
    """The attention backend vLLM chose for the layer ``layer_name`` (None if not found)."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", {})
    layer = context.get(layer_name)
    get_backend = getattr(layer, "get_attn_backend", None)
    return get_backend() if get_backend is not None else getattr(layer, "attn_backend", None)
