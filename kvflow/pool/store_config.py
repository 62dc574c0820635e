"""SharedStoreConfig's former module, kept for one release: import it from
``kvflow.pool.config`` (or ``kvflow``). Importing this module warns (DeprecationWarning).
"""

from __future__ import annotations

import warnings

from kvflow.pool.config import SharedStoreConfig

__all__ = ["SharedStoreConfig"]

warnings.warn(
    "kvflow.pool.store_config is deprecated: import SharedStoreConfig from kvflow.pool.config "
    "(or kvflow)",
    DeprecationWarning,
    stacklevel=2,
)
