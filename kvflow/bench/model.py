"""A synthetic decoder with a paged KV cache, for measuring TTFT with real per-layer compute.

Each layer (pre-norm): Q/K/V projections of the new tokens, their K/V written into the paged
cache, attention of the new tokens over every cached token of the prompt (causal), an output
projection and an MLP. Weights are random; what matters is that the compute and the KV bytes
are real, and that the same KV bytes give the same output bit for bit.

Caches are vLLM-shaped: ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer (K and V
as two parts), or ``[num_blocks, block_size, latent_dim]`` for MLA, where one latent vector per
token serves as both K and V of every head. The model runs where its ``device`` says (CPU, or
a CUDA GPU for ``kvflow bench ttft --device cuda``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvflow.layout import KVLayout

__all__ = ["ModelShape", "PagedModel"]

VOCAB = 4096


@dataclass(frozen=True)
class ModelShape:
    """The model's dimensions. ``mla_dim > 0`` selects an MLA latent cache of that width."""

    layers: int = 32
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 1024
    mla_dim: int = 0
    dtype: str = "float32"
    block_size: int = 16

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        return dtype

    @property
    def kv_bytes_per_token_layer(self) -> int:
        width = self.mla_dim if self.mla_dim else 2 * self.kv_heads * self.head_dim
        return int(width * torch.empty((), dtype=self.torch_dtype).element_size())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PagedModel:
    """Weights, an embedding table and one paged KV cache tensor per layer.

    ``layer(i, x, q_pos, first_block, n_ctx)`` runs layer i for the hidden states ``x`` of the
    tokens at absolute positions ``q_pos`` of a request whose blocks are consecutive from
    ``first_block``: their K/V are written into their slots, and they attend causally to the
    ``n_ctx`` tokens of the request, read in place from the cache as a paged-attention kernel
    would (no gathered copy). Not thread-safe; the caller owns the compute thread.
    """

    def __init__(
        self, shape: ModelShape, num_blocks: int, *, seed: int = 0, device: str = "cpu"
    ) -> None:
        self.shape = shape
        self.device = torch.device(device)
        dt = shape.torch_dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)
        s = shape
        q_width = s.heads * (s.mla_dim or s.head_dim)
        kv_width = s.mla_dim or 2 * s.kv_heads * s.head_dim

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen, device=self.device)

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            return (randn(fan_in, fan_out) / fan_in**0.5).to(dt)

        self.embed = randn(VOCAB, s.hidden).to(dt)
        self.weights = [
            {
                "q": weight(s.hidden, q_width),
                "kv": weight(s.hidden, kv_width),
                "o": weight(q_width, s.hidden),
                "up": weight(s.hidden, s.mlp),
                "down": weight(s.mlp, s.hidden),
            }
            for _ in range(s.layers)
        ]
        if s.mla_dim:
            self.caches = [
                torch.zeros(num_blocks, s.block_size, s.mla_dim, dtype=dt, device=self.device)
                for _ in range(s.layers)
            ]
        else:
            self.caches = [
                torch.zeros(
                    2, num_blocks, s.block_size, s.kv_heads, s.head_dim, dtype=dt, device=device
                )
                for _ in range(s.layers)
            ]

    def layout(self) -> KVLayout:
        if self.shape.mla_dim:
            return KVLayout.from_mla_tensors(self.caches, block_size=self.shape.block_size)
        return KVLayout.from_kv_split_tensors(self.caches, block_size=self.shape.block_size)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[(tokens % VOCAB).to(self.device)]

    def layer(
        self, i: int, x: torch.Tensor, q_pos: torch.Tensor, first_block: int, n_ctx: int
    ) -> torch.Tensor:
        s, w = self.shape, self.weights[i]
        n_q = x.shape[0]
        d = s.mla_dim or s.head_dim
        base = first_block * s.block_size
        new_slots = q_pos + base
        h = F.rms_norm(x, (s.hidden,))
        q = (h @ w["q"]).view(n_q, s.heads, d)
        kv = h @ w["kv"]
        if s.mla_dim:
            flat = self.caches[i].view(-1, s.mla_dim)
            flat.index_copy_(0, new_slots, kv)
            k = v = flat[base : base + n_ctx].unsqueeze(1)  # one latent serves every head
        else:
            kv = kv.view(n_q, 2, s.kv_heads, d)
            k = self.caches[i][0].view(-1, s.kv_heads, d)
            v = self.caches[i][1].view(-1, s.kv_heads, d)
            k.index_copy_(0, new_slots, kv[:, 0])
            v.index_copy_(0, new_slots, kv[:, 1])
            k, v = k[base : base + n_ctx], v[base : base + n_ctx]
        o = _attention(q, k, v, q_pos)
        x = x + o.reshape(n_q, -1) @ w["o"]
        return x + F.silu(F.rms_norm(x, (s.hidden,)) @ w["up"]) @ w["down"]


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    """Causal attention of queries ``[n_q, heads, d]`` over keys/values ``[n_ctx, kv_heads, d]``
    (kv_heads divides heads), query j at absolute position ``q_pos[j]``."""
    n_q, heads, d = q.shape
    n_ctx, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    if n_q == n_ctx:  # the whole prompt: the fused kernel
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)
    qg = q.view(n_q, kv_heads, group, d)
    scores = torch.einsum("qhgd,nhd->hgqn", qg, k) * d**-0.5
    future = torch.arange(n_ctx, device=q.device)[None, :] > q_pos[:, None]
    scores.masked_fill_(future, float("-inf"))
    return torch.einsum("hgqn,nhd->qhgd", torch.softmax(scores, -1), v).reshape(n_q, heads, d)
