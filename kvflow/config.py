"""EngineConfig: how a TransferEngine keys, batches, paces and times its transfers.

``spare_cpus``, ``server_cpus`` and ``cpu_list`` are re-exported from ``kvflow.cpus`` (CPU
placement), where they live.

Declared with ``kvflow.fields`` like every kvflow config; ``parse_size`` and ``from_dict`` are
re-exported from there.
"""

from __future__ import annotations

from kvflow.cpus import available_cpus, cpu_list, server_cpus, spare_cpus
from kvflow.fields import (
    Config,
    count,
    cpus,
    flag,
    from_dict,
    parse_size,
    seconds,
    size,
    text,
)

__all__ = [
    "DEFAULT_CHUNK_BLOCKS",
    "DEFAULT_COPY_THREADS",
    "DEFAULT_COPY_TIMEOUT_S",
    "DEFAULT_MAX_TRANSFER_BYTES",
    "DEFAULT_OP_TIMEOUT_S",
    "DEFAULT_PREFETCH_LAYERS",
    "DEFAULT_SAVE_BACKLOG",
    "EngineConfig",
    "cpu_list",
    "from_dict",
    "parse_size",
    "server_cpus",
    "spare_cpus",
]

DEFAULT_CHUNK_BLOCKS = 4
DEFAULT_PREFETCH_LAYERS = 2
DEFAULT_SAVE_BACKLOG = 4
DEFAULT_COPY_THREADS = 1
DEFAULT_MAX_TRANSFER_BYTES = 64 << 20
DEFAULT_COPY_TIMEOUT_S = 10.0
DEFAULT_OP_TIMEOUT_S = 30.0


def _offline(chosen: tuple[int, ...]) -> str | None:
    """Why the ``chosen`` CPUs cannot take a pinned thread: those not online (None: all are,
    or off Linux, where nothing can be checked)."""
    available = available_cpus() if chosen else set()
    missing = sorted(set(chosen) - available) if available else []
    return f"CPUs {missing} are not online" if missing else None


class EngineConfig(Config):
    """How a TransferEngine keys, batches, paces and times its transfers.

    Fields:
        model: model name; part of every key's namespace.
        rank: this process's tensor-parallel rank; part of every key.
        chunk_blocks: blocks per pool object (one key per chunk, all layers inside).
        prefetch_layers: a load copies at most this many layers ahead of the consumer.
        save_backlog: a save holds at most this many written-but-not-copied layers; the
            producer waits in ``layer_written`` beyond that (inline and deferred saves, below,
            take no slot).
        copy_threads: threads of the copy executor.
        copy_cpus: CPUs the copy threads pin themselves to (empty: no pinning).
        max_transfer_bytes: coalesced ranges above this are split (accepts "64MiB").
        copy_timeout_s: one layer's copy may take this long before its chunks are failed.
        op_timeout_s: a store metadata call, or a whole-request wait, may take this long.
        inline_saves: with ``SyncTransferEngine`` on host memory and a store that saves into
            memory mapped here (``Store.saves_in_memory``), ``layer_written`` copies the layer
            on the caller's thread, and the layers reach the engine's loop together after the
            last one: a copy thread and the loop running Python beside the caller's forward
            take the GIL from it at every torch op (``benchmarks/save_interference.py``).
            False: every layer goes to the copy thread.
        deferred_saves: with ``SyncTransferEngine`` on host memory where inline saves do not
            apply (a store whose save may wait: Mooncake, memcache, a wrapper; or
            ``inline_saves`` off), the written layers reach the loop and the copy threads
            together after the last one, in one hop, instead of one by one beside the forward
            (the GIL, as above); their copies then run while the caller waits for the save,
            within that wait's timeout. False: each layer as it is written.
    """

    model: str = text(default="default", empty=False)
    rank: int = count(default=0, low=0)
    chunk_blocks: int = count(default=DEFAULT_CHUNK_BLOCKS)
    prefetch_layers: int = count(default=DEFAULT_PREFETCH_LAYERS)
    save_backlog: int = count(default=DEFAULT_SAVE_BACKLOG)
    copy_threads: int = count(default=DEFAULT_COPY_THREADS)
    copy_cpus: tuple[int, ...] = cpus(default=(), check=_offline)
    max_transfer_bytes: int | str = size(default=DEFAULT_MAX_TRANSFER_BYTES, low=1)
    copy_timeout_s: float = seconds(default=DEFAULT_COPY_TIMEOUT_S)
    op_timeout_s: float = seconds(default=DEFAULT_OP_TIMEOUT_S)
    inline_saves: bool = flag(default=True)
    deferred_saves: bool = flag(default=True)

    @property
    def transfer_limit(self) -> int:
        """``max_transfer_bytes`` as an int (it holds one; its annotation says what it takes)."""
        return int(self.max_transfer_bytes)
