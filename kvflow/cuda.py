"""Moved to ``kvflow.copying.cuda``; this name is kept one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from kvflow.copying.cuda import (
    MEMCPY_DEFAULT,
    CopyRuntime,
    CudaRuntime,
    gpu_present,
    pin_host,
    runtime,
)

__all__ = ["MEMCPY_DEFAULT", "CopyRuntime", "CudaRuntime", "gpu_present", "pin_host", "runtime"]

warnings.warn(
    "kvflow.cuda is deprecated: use kvflow.copying.cuda", DeprecationWarning, stacklevel=2
)
