"""The fields a pool message's body is made of: little-endian integers, arrays and key lists.

``Reader`` decodes them checking every length against what is left of the body, and
``encode_keys`` writes a key list as ``kvflow.pool.protocol`` specifies it (``u32 n, n x u16
length, the UTF-8 bytes of every key back to back``), refusing what a decoder would refuse.
Pure functions over bytes; no state is shared, so any thread may use them.
"""

from __future__ import annotations

import struct

import numpy as np

from kvflow.errors import InvalidArgumentError, ProtocolError

__all__ = ["MAX_KEYS", "MAX_KEY_BYTES", "U32", "U64", "Reader", "encode_keys"]

MAX_KEYS = 1 << 20
MAX_KEY_BYTES = 1024
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


class Reader:
    """Reads fields from a body, checking every length against what is left."""

    def __init__(self, body: bytes) -> None:
        self._body = memoryview(body)
        self._at = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self._at + n > len(self._body):
            raise ProtocolError(f"{what}: needs {n} bytes, {len(self._body) - self._at} left")
        out = self._body[self._at : self._at + n]
        self._at += n
        return out

    def u32(self, what: str) -> int:
        value: int = U32.unpack(self.take(4, what))[0]
        return value

    def u64(self, what: str) -> int:
        value: int = U64.unpack(self.take(8, what))[0]
        return value

    def array(self, dtype: type, n: int, what: str) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        out: np.ndarray = np.frombuffer(self.take(n * size, what), dtype=dtype).copy()
        return out

    def keys(self) -> tuple[str, ...]:
        n = self.u32("key count")
        if n > MAX_KEYS:
            raise ProtocolError(f"key count {n} above the limit {MAX_KEYS}")
        lengths = self.array(np.dtype("<u2").type, n, "key lengths").astype(np.int64)
        if n and int(lengths.max()) > MAX_KEY_BYTES:
            raise ProtocolError(f"a key of {int(lengths.max())} bytes (limit {MAX_KEY_BYTES})")
        blob = bytes(self.take(int(lengths.sum()), "key bytes"))
        ends = np.cumsum(lengths).tolist()
        starts = [0, *ends][:n]
        try:
            return tuple(blob[a:b].decode("utf-8") for a, b in zip(starts, ends, strict=True))
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"a key is not UTF-8: {exc.reason}") from exc

    def end(self) -> None:
        left = len(self._body) - self._at
        if left:
            raise ProtocolError(f"{left} unexpected trailing bytes")


def encode_keys(keys: tuple[str, ...] | list[str]) -> bytes:
    try:
        raw = [k.encode("utf-8") for k in keys]
    except (UnicodeEncodeError, AttributeError) as exc:
        raise InvalidArgumentError("keys", keys, "keys must be strings encodable as UTF-8") from exc
    if len(raw) > MAX_KEYS:
        raise InvalidArgumentError("keys", len(raw), f"more than {MAX_KEYS} keys in one call")
    lengths = np.fromiter((len(b) for b in raw), dtype=np.int64, count=len(raw))
    if len(raw) and int(lengths.max()) > MAX_KEY_BYTES:
        longest = keys[int(lengths.argmax())]
        raise InvalidArgumentError("keys", longest, f"a key is limited to {MAX_KEY_BYTES} bytes")
    return U32.pack(len(raw)) + lengths.astype("<u2").tobytes() + b"".join(raw)
