"""Pool keys: prefix-chained chunk hashes of token ids, under a namespace and a rank.

A key is ``namespace/rank/chunk_hash``. The namespace holds the model name and the layout's
fingerprint, the chunk size, the layer count and the key-format version, so two layouts never read
each other's bytes. Chunk hashes are chained: chunk i's hash covers every token of chunks 0..i, so
equal keys mean equal prefixes. They are BLAKE2b digests, identical across processes and runs.
Only full chunks have keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import numpy as np

from kvflow._validate import int_vector
from kvflow.errors import InvalidArgumentError

__all__ = ["KEY_FORMAT_VERSION", "ChunkHashes", "KeySpace", "chunk_hashes", "token_array"]

KEY_FORMAT_VERSION = 1
_DIGEST_BYTES = 16
_ROOT = b"kvflow-chunk-root"


def token_array(token_ids: Any, *, argument: str = "token_ids") -> np.ndarray:
    """Token ids as a 1-D int64 array; refuses floats, negatives and other shapes."""
    arr = int_vector(token_ids, argument, "token ids")
    if arr.size and arr.min() < 0:
        raise InvalidArgumentError(argument, int(arr.min()), "token ids must be >= 0")
    return arr


def chunk_hashes(tokens: np.ndarray, chunk_tokens: int) -> list[bytes]:
    """Prefix-chained digests of each full chunk of ``chunk_tokens`` tokens (int64 array)."""
    if chunk_tokens < 1:
        raise InvalidArgumentError("chunk_tokens", chunk_tokens, "must be >= 1")
    full = len(tokens) // chunk_tokens
    data = np.ascontiguousarray(tokens[: full * chunk_tokens], dtype="<i8").tobytes()
    step = chunk_tokens * 8
    prev = _ROOT
    out = []
    for i in range(full):
        prev = hashlib.blake2b(
            prev + data[i * step : (i + 1) * step], digest_size=_DIGEST_BYTES
        ).digest()
        out.append(prev)
    return out


@dataclass(frozen=True)
class ChunkHashes:
    """A request named by its chunks' prefix-chained hashes, computed elsewhere (an inference
    server's own block hashes, say), instead of by its token ids: ``(ChunkHashes(h), block_ids)``
    is a request whose ``len(h)`` full chunks go to or from ``block_ids`` (``chunk_blocks`` ids
    per chunk). Each hash must cover the whole prefix up to its chunk's end.

    ``preceding``: the hashes of the prompt's chunks before ``hashes`` (chunks 0 to k-1 when
    ``hashes`` starts at chunk k), for a request that moves only the later chunks of a prompt
    (its new chunks, or those after what the caller's own cache holds). They are not moved and
    need no block ids: a pool that orders eviction by prefix (the prefix context of a Store) only
    touches them after the moved chunks, so that it evicts the prompt's tail before its head."""

    hashes: tuple[bytes, ...]
    preceding: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hashes", "preceding"):
            hashes = tuple(getattr(self, name))
            for i, h in enumerate(hashes):
                if not isinstance(h, bytes) or not h:
                    raise InvalidArgumentError(f"{name}[{i}]", h, "expected non-empty bytes")
            object.__setattr__(self, name, hashes)

    def __len__(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class KeySpace:
    """Turns chunk hashes into store keys for one (model, layout, chunk size, rank)."""

    namespace: str
    rank: int

    @classmethod
    def for_layout(
        cls, *, model: str, layout_fingerprint: str, chunk_blocks: int, num_layers: int, rank: int
    ) -> KeySpace:
        name = quote(model, safe="")
        ns = (
            f"kvflow-v{KEY_FORMAT_VERSION}:{name}:{layout_fingerprint}"
            f":c{chunk_blocks}:l{num_layers}"
        )
        return cls(namespace=ns, rank=rank)

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        prefix = f"{self.namespace}/{self.rank}/"
        return [prefix + h.hex() for h in hashes]
