"""ConnectorConfig: ``kv_connector_extra_config`` of the vLLM connector, parsed once.

No vLLM import here: the config is validated (and tested) without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Literal

from kvflow.config import (
    DEFAULT_COPY_THREADS,
    DEFAULT_COPY_TIMEOUT_S,
    DEFAULT_OP_TIMEOUT_S,
    DEFAULT_PREFETCH_LAYERS,
    DEFAULT_SAVE_BACKLOG,
    EngineConfig,
    spare_cpus,
)
from kvflow.errors import ConfigError
from kvflow.fields import Config, choice, count, cpus, flag, seconds, settings, size, text
from kvflow.layout import device_kind
from kvflow.pool.config import SharedStoreConfig
from kvflow.stores.memcache.config import MemcacheConfig
from kvflow.stores.mooncake.config import MooncakeConfig

__all__ = ["AUTO", "ROLES", "STORES", "ConnectorConfig"]

STORES = ("shared", "mooncake", "memcache", "local")
# vLLM's ``kv_transfer_config.kv_role``: a prefill node, a decode node, or both at once
ROLES = ("kv_producer", "kv_consumer", "kv_both")
AUTO: Literal["auto"] = "auto"
# a hit ends at a chunk boundary: a turn's prompt beyond its last whole chunk is recomputed.
# Measured in vllm serve (docs/benchmarks.md, "chunk size"): 64 tokens got multi-turn chat 17 %
# more hit tokens than 256 and TTFT below MooncakeStoreConnector's, for 7 % on long shared prefixes
DEFAULT_CHUNK_TOKENS = 64


class ConnectorConfig(Config):
    """The connector's settings; every key of ``kv_connector_extra_config``.

    Fields:
        store: ``shared`` (the node-local pool, ``kvflow serve``; started on first use unless
            ``shared.auto_start`` is false), ``mooncake`` (Mooncake Store), ``memcache``
            (Ascend memcache, see docs/ascend.md), or ``local`` (an
            embedded pool: only when vLLM runs scheduler and worker in one process,
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        shared: SharedStoreConfig keys (``socket``, ``capacity``, ``timeout_s``...).
        mooncake: MooncakeConfig keys; without them, ``MooncakeConfig.from_env()``. The
            scheduler connects as a pure client (no segment) whatever this says.
        memcache: MemcacheConfig keys; without them, ``MemcacheConfig.from_env()``. Unless
            given, a worker's ``device_id`` is its KV caches' device index and its
            ``local_memory`` is ``device`` for NPU caches, ``host`` otherwise.
        local_capacity: the embedded pool's size.
        chunk_blocks: vLLM blocks per pool object (default: 64 tokens' worth, at least 1).
            Hits are whole chunks, then with ``tail_chunks`` a tail.
        tail_chunks: also store a prompt's last whole blocks short of a chunk (its tail), as
            one more object, and find them: a prompt that extends a stored one (the next turn
            of a conversation, a resumed request, a decode node's prompt) then hits up to its
            last whole block instead of its last whole chunk (not with a sliding window or
            several KV cache groups).
        use_layerwise: load layer by layer while the model computes (true), or load every layer
            before the forward (false: the comparison point).
        save: store newly computed prompt chunks; load: look up and load them. What an
            instance saves also depends on vLLM's ``kv_role`` (``saves_as``).
        save_decode_cache: also store the chunks of generated tokens (the KV a multi-turn
            follow-up reuses), each once its tokens are final (the step after the one that
            computed its last token). On a ``kv_consumer``, which otherwise saves nothing, it
            also stores the prompt chunks it computed itself (as vLLM's
            ``MooncakeStoreConnector``'s key of the same name).
        prefetch_layers, save_backlog, copy_threads, op_timeout_s, copy_timeout_s,
            inline_saves, deferred_saves: the TransferEngine's (``EngineConfig``).
        save_across_steps: a step's save may end (its last copies, its commit) while the next
            step runs: ``wait_for_save`` leaves it going, and the next step waits for it
            before its forward only if vLLM freed a block it reads (its request finished or
            was preempted) or the step loads, else at its own end. Never on a
            ``kv_producer`` (its answer means its chunks are in the pool), for a request of
            one output token, with a sliding window (vLLM frees blocks a running request's
            window left), where vLLM writes new blocks before the forward (zeroing them:
            mixed precisions), or with sleep mode. Off by default: with KV caches in host
            memory the save's copies then run beside the next forward, on the same CPUs, and
            measured no faster (docs/benchmarks.md, "vllm serve").
        copy_cpus: CPUs the copy threads (and a worker's Mooncake client threads) are pinned
            to; ``"auto"`` (the default): with KV caches in host memory, the CPUs of vLLM's
            own set that none of the worker's threads is bound to (``kvflow.spare_cpus``:
            vLLM's CPU worker binds each compute thread to a core, and leaves the reserved
            ones), no pinning where no thread is bound or the caches are on an accelerator;
            ``[]``: no pinning (the threads inherit the model thread's affinity, its core).
        lookup_timeout_s: the scheduler's pool lookup may take this long; then it is a miss.
        model: the keys' model name (default: vLLM's served model name).
        debug_corrupt_loads: a test hook: overwrite every loaded block with garbage after the
            load (proves the loaded KV is really used). Never set it in production.
        debug_fail_loads: a test hook: report every loaded block as failed (vLLM then
            recomputes them, or fails the request, per its ``kv_load_failure_policy``).
        debug_skip_saves: a test hook: the worker saves nothing (with ``debug_rank``: as if
            the pool had lost that rank's objects).
        debug_rank: the debug hooks act only in the worker of this tensor-parallel rank
            (default: in every worker), as a failure of one rank would.
    """

    store: str = choice(STORES, default="shared")
    shared: Mapping[str, Any] = settings(default_factory=dict)
    mooncake: Mapping[str, Any] = settings(default_factory=dict)
    memcache: Mapping[str, Any] = settings(default_factory=dict)
    local_capacity: int | str = size(default="4GiB")
    chunk_blocks: int = count(default=0, low=0)  # 0: DEFAULT_CHUNK_TOKENS' worth
    tail_chunks: bool = flag(default=True)
    use_layerwise: bool = flag(default=True)
    save: bool = flag(default=True)
    load: bool = flag(default=True)
    save_decode_cache: bool = flag(default=False)
    prefetch_layers: int = count(default=DEFAULT_PREFETCH_LAYERS)
    save_backlog: int = count(default=DEFAULT_SAVE_BACKLOG)
    copy_threads: int = count(default=DEFAULT_COPY_THREADS)
    copy_cpus: tuple[int, ...] | Literal["auto"] = cpus(default=AUTO, also=(AUTO,))
    op_timeout_s: float = seconds(default=DEFAULT_OP_TIMEOUT_S)
    copy_timeout_s: float = seconds(default=DEFAULT_COPY_TIMEOUT_S)
    inline_saves: bool = flag(default=True)
    deferred_saves: bool = flag(default=True)
    save_across_steps: bool = flag(default=False)
    lookup_timeout_s: float = seconds(default=2.0)
    model: str = text(default="")
    debug_corrupt_loads: bool = flag(default=False)
    debug_fail_loads: bool = flag(default=False)
    debug_skip_saves: bool = flag(default=False)
    debug_rank: int | None = count(default=None, low=0, also=(None,))

    def __post_init__(self) -> None:
        """The checks across fields: the engine's own (CPUs online), and the chosen store's
        section, now rather than when the store opens."""
        self.engine_config(block_size=16, model="check")
        if self.store == "shared":
            _nested("shared", self.shared_config)
        elif self.store == "mooncake" and self.mooncake:
            _nested("mooncake", lambda: self.mooncake_config(pure_client=False))
        elif self.store == "memcache" and self.memcache:
            _nested("memcache", self.memcache_config)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """From ``kv_connector_extra_config`` (None or {} gives the defaults). Unknown keys
        are an error that lists the known ones."""
        return cls.from_dict(extra or {})

    def saves_as(self, kv_role: object) -> bool:
        """Whether an instance in vLLM's ``kv_role`` stores chunks: a ``kv_producer`` (a
        prefill node: it also loads hits, as a shared system prompt) and ``kv_both`` do, unless
        ``save`` is false; a ``kv_consumer`` (a decode node: it loads what the producer stored)
        only with ``save_decode_cache``. ConfigError naming ``kv_role`` for any other value."""
        if not isinstance(kv_role, str) or kv_role not in ROLES:
            raise ConfigError("kv_role", kv_role, f"expected one of {ROLES}")
        return self.save and (kv_role != "kv_consumer" or self.save_decode_cache)

    def chunk_blocks_for(self, block_size: int) -> int:
        return self.chunk_blocks or max(1, DEFAULT_CHUNK_TOKENS // block_size)

    def copy_cpus_here(self, device: str) -> tuple[int, ...]:
        """The copy CPUs for a worker (this process) with its KV caches on ``device``: the
        configured ones, or with ``"auto"`` and CPU caches ``spare_cpus()``, to be called once
        vLLM has bound its threads (an accelerator's copies are DMA the thread only issues:
        no pinning, which could put them on another NUMA node than the pinned memory)."""
        if not isinstance(self.copy_cpus, str):  # a list, normalised: not "auto"
            return self.copy_cpus
        return spare_cpus() if device_kind(device) == "cpu" else ()

    def engine_config(
        self,
        *,
        block_size: int,
        model: str,
        rank: int = 0,
        copy_cpus: tuple[int, ...] | None = None,
    ) -> EngineConfig:
        """The engine's settings; ``copy_cpus`` as the worker resolved them
        (``copy_cpus_here``), by default the configured list (``"auto"``: none)."""
        if copy_cpus is None:
            copy_cpus = () if isinstance(self.copy_cpus, str) else self.copy_cpus
        return EngineConfig(
            model=self.model or model,
            rank=rank,
            chunk_blocks=self.chunk_blocks_for(block_size),
            prefetch_layers=self.prefetch_layers,
            save_backlog=self.save_backlog,
            copy_threads=self.copy_threads,
            copy_cpus=copy_cpus,
            op_timeout_s=self.op_timeout_s,
            copy_timeout_s=self.copy_timeout_s,
            inline_saves=self.inline_saves,
            deferred_saves=self.deferred_saves,
        )

    def shared_config(self) -> SharedStoreConfig:
        """The shared pool's client settings: ``auto_start`` on unless said otherwise."""
        return SharedStoreConfig.from_dict({"auto_start": True, **self.shared})

    def mooncake_config(self, *, pure_client: bool) -> MooncakeConfig:
        """Mooncake settings (from the ``mooncake`` keys, else the environment); a pure client
        gives no segment (the scheduler only looks up)."""
        base = MooncakeConfig.from_dict(self.mooncake) if self.mooncake else None
        config = base or MooncakeConfig.from_env()
        return replace(config, global_segment_size=0) if pure_client else config

    def memcache_config(self, device: Any = "cpu") -> MemcacheConfig:
        """memcache settings (from the ``memcache`` keys, else the environment) for a client
        whose KV caches are on ``device``: its index is the ``device_id`` and an NPU's memory
        is copied with the device copy types, unless the keys say otherwise."""
        config = MemcacheConfig.from_dict(self.memcache) if self.memcache else None
        config = config or MemcacheConfig.from_env()
        given = self.memcache or {}
        changes: dict[str, Any] = {}
        _, _, number = str(device).partition(":")
        index = int(number) if number.isdigit() else None
        if "device_id" not in given and index is not None:
            changes["device_id"] = int(index)
        if "local_memory" not in given:
            changes["local_memory"] = "device" if device_kind(device) == "npu" else "host"
        return replace(config, **changes) if changes else config


def _nested(section: str, build: Callable[[], object]) -> None:
    """Build a nested store config; its errors name the section (``shared.timeout_s``)."""
    try:
        build()
    except ConfigError as exc:
        raise ConfigError(f"{section}.{exc.argument}", exc.value, exc.reason) from None
