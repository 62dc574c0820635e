"""The shared pool's config: ``PoolConfig`` (how a server is set up) and ``SharedStoreConfig``
(how a SharedStore reaches, or starts, its server), with the defaults they share.

Both are ``kvflow.fields`` configs: frozen dataclasses, each value converted and checked when
built; plain values, safe to share between threads.
"""

from __future__ import annotations

from kvflow.fields import Config, choice, count, flag, path, seconds, size, uids
from kvflow.pool.paths import default_socket, socket_too_long
from kvflow.stores.arena import SLOT_ALIGN

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_MAX_CLIENTS",
    "PoolConfig",
    "SharedStoreConfig",
]

DEFAULT_CAPACITY = "1GiB"
DEFAULT_LEASE_TTL_S = 300.0
DEFAULT_MAX_CLIENTS = 256
DEFAULT_IDLE_TIMEOUT_S = 60.0
DISK_READS = ("layerwise", "promote")  # how a disk hit is loaded (``kvflow.pool.tier``)


def _permission_bits(mode: int) -> str | None:
    return None if 0 < mode <= 0o777 else "must be permission bits such as 0o600"


class PoolConfig(Config):
    """How a pool server is set up.

    Fields:
        socket: the Unix socket path (default: ``kvflow.pool.paths.default_socket()``).
        capacity: arena bytes (accepts "8GiB"); allocated at start.
        lease_ttl_s: a read lease is released after this long even if its client lives on.
            It must exceed the longest load; it only guards against clients that leak leases.
        allow_uids: peers of these uids are accepted besides the server's own uid.
        socket_mode: permission bits of the socket file.
        max_clients: connections served at once; more are refused with a reply saying so.
        idle_timeout_s: a connection that holds no session (no pending write, no read lease)
            and sends nothing for this long is closed, so that idle or stuck peers cannot keep
            others out. A SharedStore reconnects on its next call, without failing it.
        disk_dir: a folder for the disk tier (``kvflow.pool.tier``); empty: DRAM only. What
            it holds is served again after a restart.
        disk_capacity: the disk tier's bytes at most (needed with ``disk_dir``); checked
            against the free space of its filesystem at start.
        disk_reads: how a client loads a chunk found on disk only: ``layerwise`` (each layer
            read from the file into the destination while earlier layers compute, the chunk
            promoted into DRAM in the background) or ``promote`` (copied into DRAM first).
    """

    socket: str = path(default="", absolute=True, when_empty=default_socket, check=socket_too_long)
    capacity: int | str = size(default=DEFAULT_CAPACITY, low=SLOT_ALIGN)
    lease_ttl_s: float = seconds(default=DEFAULT_LEASE_TTL_S)
    allow_uids: tuple[int, ...] = uids(default=())
    socket_mode: int = count(default=0o600, low=0, check=_permission_bits)
    max_clients: int = count(default=DEFAULT_MAX_CLIENTS)
    idle_timeout_s: float = seconds(default=DEFAULT_IDLE_TIMEOUT_S)
    disk_dir: str = path(default="", absolute=True)
    disk_capacity: int | str = size(default=0)
    disk_reads: str = choice(DISK_READS, default="layerwise")

    @property
    def size(self) -> int:
        """``capacity`` as an int (it holds one; its annotation says what it takes)."""
        return int(self.capacity)


class SharedStoreConfig(Config):
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
        pin: page-lock this process's mapping of the arena for GPU copies (``kvflow.copying.cuda``):
            ``None`` when a CUDA GPU is present, ``True`` always, ``False`` never.
        disk_dir, disk_capacity, disk_reads: the disk tier of a server this client starts
            (``PoolConfig``'s).
    """

    socket: str = path(default="", absolute=True, when_empty=default_socket, check=socket_too_long)
    timeout_s: float = seconds(default=5.0)
    retry_interval_s: float = seconds(default=0.5)
    auto_start: bool = flag(default=False)
    capacity: int | str = size(default=DEFAULT_CAPACITY)  # the server's PoolConfig checks it
    lease_ttl_s: float = seconds(default=DEFAULT_LEASE_TTL_S)
    start_timeout_s: float = seconds(default=60.0)
    populate: bool = flag(default=False)
    server_uids: tuple[int, ...] = uids(default=())
    pin: bool | None = flag(default=None, also=(None,))
    disk_dir: str = path(default="", absolute=True)
    disk_capacity: int | str = size(default=0)
    disk_reads: str = choice(DISK_READS, default="layerwise")

    def server_config(self) -> PoolConfig:
        return PoolConfig(
            socket=self.socket,
            capacity=self.capacity,
            lease_ttl_s=self.lease_ttl_s,
            disk_dir=self.disk_dir,
            disk_capacity=self.disk_capacity,
            disk_reads=self.disk_reads,
        )
