"""Moved to ``kvflow.testing.models``; this name is kept one release, with a DeprecationWarning.

``python -m kvflow.integrations.vllm.random_model DIR ...`` still builds (and warns).
"""

from __future__ import annotations

import warnings

from kvflow.testing.models import FAMILIES, VOCAB, build, main

__all__ = ["FAMILIES", "VOCAB", "build", "main"]

warnings.warn(
    "kvflow.integrations.vllm.random_model is deprecated: use kvflow.testing.models",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    main()
