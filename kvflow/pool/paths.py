"""Where a pool server listens: a socket in a private directory, and the files beside it.

By default the socket is ``/dev/shm/kvflow-<uid>/pool.sock`` (``$KVFLOW_POOL_SOCKET`` overrides
it). The directory is created with mode 0700 and refused if another user owns it or others may
write to it, so no other user can plant a socket or read the pool's files. Beside the socket:
``.lock`` (held by the running server: one server per path), ``.pid`` and ``.log`` (detached
servers), ``.start`` (held by the client that is starting one).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvflow.errors import ConfigError

__all__ = [
    "SOCKET_ENV",
    "check_socket_path",
    "default_socket",
    "ensure_private_directory",
    "sibling",
    "socket_too_long",
]

SOCKET_ENV = "KVFLOW_POOL_SOCKET"
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL


def default_socket() -> str:
    """The socket path clients and servers use when none is given."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return str(base / f"kvflow-{os.getuid()}" / "pool.sock")


def socket_too_long(path: str) -> str | None:
    """Why ``path`` cannot name a Unix socket: longer than ``sun_path`` holds (None: it fits)."""
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        return f"is longer than {_MAX_SOCKET_PATH} bytes"
    return None


def check_socket_path(path: str) -> str:
    """``path`` made absolute; ConfigError naming ``socket`` if it is empty or too long."""
    if not isinstance(path, str) or not path:
        raise ConfigError("socket", path, "must be a non-empty path")
    path = os.path.abspath(path)
    reason = socket_too_long(path)
    if reason:
        raise ConfigError("socket", path, reason)
    return path


def sibling(socket_path: str, suffix: str) -> str:
    return socket_path + suffix


def ensure_private_directory(directory: str) -> None:
    """Create ``directory`` (mode 0700) or check that an existing one is private to us."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise ConfigError("socket", directory, f"cannot create its directory: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError("socket", directory, "its directory is not a directory (a symlink?)")
    if info.st_uid != os.getuid():
        raise ConfigError("socket", directory, f"its directory belongs to uid {info.st_uid}")
    if info.st_mode & 0o022:  # 0711 (others may traverse, for --allow-uid) is fine
        raise ConfigError(
            "socket",
            directory,
            f"its directory is writable by others (mode {stat.S_IMODE(info.st_mode):o})",
        )
