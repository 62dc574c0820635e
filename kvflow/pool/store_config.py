"""SharedStoreConfig: how a SharedStore reaches (or starts) its pool server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.config import _positive_float, from_dict, parse_size
from kvflow.errors import ConfigError
from kvflow.pool.paths import check_socket_path, default_socket
from kvflow.pool.server import DEFAULT_CAPACITY, DEFAULT_LEASE_TTL_S, PoolConfig

__all__ = ["SharedStoreConfig"]


@dataclass(frozen=True)
class SharedStoreConfig:
    """How a SharedStore reaches its server.

    Fields:
        socket: the server's socket (default: ``$KVFLOW_POOL_SOCKET`` or
            ``/dev/shm/kvflow-<uid>/pool.sock``).
        timeout_s: each request (and the connect) may take this long; then the pool counts as
            down until it answers again.
        retry_interval_s: after a failed connect, calls fail at once (store down) for this long
            before the next attempt.
        auto_start: start a server if none listens (many clients may race: one server wins).
        capacity, lease_ttl_s: the settings of a server this client starts.
        start_timeout_s: how long to wait for a server this client started.
        populate: map the whole arena into this process at connect (slower connect, no page
            faults on first copies).
        server_uids: uids whose server is trusted besides this process's own (the server's
            uid and the socket directory's owner are checked at every connect).
        pin: page-lock this process's mapping of the arena for GPU copies (``kvflow.cuda``):
            ``None`` when a CUDA GPU is present, ``True`` always, ``False`` never.
    """

    socket: str = ""
    timeout_s: float = 5.0
    retry_interval_s: float = 0.5
    auto_start: bool = False
    capacity: int | str = DEFAULT_CAPACITY
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    start_timeout_s: float = 60.0
    populate: bool = False
    server_uids: tuple[int, ...] = ()
    pin: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "socket", check_socket_path(self.socket or default_socket()))
        for name in ("timeout_s", "retry_interval_s", "lease_ttl_s", "start_timeout_s"):
            _positive_float(name, getattr(self, name))
        object.__setattr__(self, "capacity", parse_size(self.capacity, argument="capacity"))
        for name in ("auto_start", "populate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "must be true or false")
        uids = tuple(self.server_uids)
        if any(isinstance(u, bool) or not isinstance(u, int) or u < 0 for u in uids):
            raise ConfigError("server_uids", self.server_uids, "must be user ids (integers >= 0)")
        object.__setattr__(self, "server_uids", uids)
        if self.pin not in (None, True, False):
            raise ConfigError("pin", self.pin, "expected null (when a GPU is present), true, false")

    def server_config(self) -> PoolConfig:
        return PoolConfig(socket=self.socket, capacity=self.capacity, lease_ttl_s=self.lease_ttl_s)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SharedStoreConfig:
        """Build from a plain dict; unknown keys are an error that lists the known ones."""
        return from_dict(cls, values)
