"""Moved to ``kvflow.copying.host``; this name is kept one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from kvflow.copying.host import (
    HOST_MEMCPY_ASYNC,
    NATIVE,
    STREAM_MIN_BYTES,
    MemcpyAsyncFn,
    Mover,
    copy_ranges,
    issue_ranges,
    moving_with,
    stream_min_bytes,
)

__all__ = [
    "HOST_MEMCPY_ASYNC",
    "NATIVE",
    "STREAM_MIN_BYTES",
    "MemcpyAsyncFn",
    "Mover",
    "copy_ranges",
    "issue_ranges",
    "moving_with",
    "stream_min_bytes",
]

warnings.warn(
    "kvflow.stores.copyloop is deprecated: use kvflow.copying.host",
    DeprecationWarning,
    stacklevel=2,
)
