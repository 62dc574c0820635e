"""Synthetic KV caches on CPU: one ``[num_blocks, ...]`` tensor per layer of random bytes."""

from __future__ import annotations

import torch

__all__ = ["make_caches"]


def make_caches(
    num_layers: int = 4,
    num_blocks: int = 64,
    block_shape: tuple[int, ...] = (2, 16, 8),
    dtype: torch.dtype = torch.float16,
    *,
    seed: int = 0,
) -> list[torch.Tensor]:
    """One ``[num_blocks, *block_shape]`` tensor per layer, filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(num_layers):
        raw = torch.randint(0, 256, (num_blocks, *block_shape), generator=gen, dtype=torch.uint8)
        nbytes = torch.empty((), dtype=dtype).element_size()
        shape = (num_blocks, *block_shape[:-1], block_shape[-1] // nbytes)
        caches.append(raw.view(dtype).reshape(shape) if nbytes > 1 else raw)
    return caches
