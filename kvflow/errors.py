"""Every error kvflow raises, in one place.

The hierarchy::

    KVFlowError                      base of everything kvflow raises on purpose
    ├── InvalidArgumentError         bad input to an operation (also a ValueError)
    │   ├── ConfigError              a configuration value out of range or malformed
    │   └── LayoutError              tensors kvflow cannot describe as a KVLayout
    ├── ClosedError                  an engine, handle or store used after close()
    ├── TransferTimeoutError         a wait ran past its timeout (also a TimeoutError)
    ├── StoreError                   a store call failed; ``code`` keeps the native code
    │   ├── StoreUnavailableError    the store cannot be reached at all
    │   │   └── PoolRefusedError     the shared pool's server refused the connection (says why)
    │   └── ProtocolError            a malformed message on the shared pool's socket
    ├── PoolRunningError             a pool server already serves that socket path
    └── MissingDependencyError       an optional engine is not installed (also an ImportError)

Bad input is refused before anything changes: an operation that raises
``InvalidArgumentError`` has left the pool as it was. Store failures during a transfer are not
raised to the caller; they come back as data (failed chunks in the result).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClosedError",
    "ConfigError",
    "InvalidArgumentError",
    "KVFlowError",
    "LayoutError",
    "MissingDependencyError",
    "PoolRefusedError",
    "PoolRunningError",
    "ProtocolError",
    "StoreError",
    "StoreUnavailableError",
    "TransferTimeoutError",
]

_MAX_SHOWN = 80


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


class KVFlowError(Exception):
    """Base of every error kvflow raises on purpose."""


class InvalidArgumentError(KVFlowError, ValueError):
    """An argument was refused. ``argument`` names it and ``value`` holds what was given."""

    def __init__(self, argument: str, value: Any, reason: str) -> None:
        self.argument = argument
        self.value = value
        self.reason = reason
        super().__init__(f"{argument}={_show(value)}: {reason}")


class ConfigError(InvalidArgumentError):
    """A configuration field is out of range or malformed."""


class LayoutError(InvalidArgumentError):
    """The KV tensors cannot be described as a KVLayout (kvflow never guesses a layout)."""


class ClosedError(KVFlowError):
    """An engine, handle or store was used after it was closed."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what} is closed")


class TransferTimeoutError(KVFlowError, TimeoutError):
    """A wait ran past its timeout. ``what`` says what was awaited."""

    def __init__(self, what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        super().__init__(f"{what} did not finish within {timeout_s:g} s")


class StoreError(KVFlowError):
    """A store call failed. ``code`` is the engine's native error code, when it has one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        self.code = code
        super().__init__(message if code is None else f"{message} (code {code})")


class StoreUnavailableError(StoreError):
    """The store cannot be reached: lookups miss and saves are skipped until it is back."""


class PoolRefusedError(StoreUnavailableError):
    """The pool server on ``path`` refused this connection; ``reason`` is what it said (its
    connection limit, a uid it does not accept)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"the kvflow pool server on {path} refused the connection: {reason}")


class MissingDependencyError(KVFlowError, ImportError):
    """An optional engine was chosen but its package is not installed."""

    def __init__(self, feature: str, install: str) -> None:
        self.feature = feature
        self.install = install
        super().__init__(f"{feature} needs an optional package: pip install {install}")


class ProtocolError(StoreError):
    """A message on the shared pool's socket was malformed; that connection is closed."""


class PoolRunningError(KVFlowError):
    """A pool server already serves this socket path (one server per path)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"a kvflow pool server already serves {path}")
