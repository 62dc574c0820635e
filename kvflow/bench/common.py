"""What the scenarios share: timing, argument parsing, small layouts and stores, copy set-ups,
and the matplotlib boilerplate of the ``--plot`` option (``figure`` and ``save``).

Timing is wall clock (``time.perf_counter``) everywhere: the copy scenario runs copies on
several threads, where a thread's CPU time says nothing about throughput. Noise from other work
on the machine is handled by taking the best of N repeats and by timing the things a ratio
compares in turn inside every repeat, so that a slow spell hits both sides.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.config import EngineConfig, cpu_list, parse_size
from kvflow.errors import ConfigError, MissingDependencyError
from kvflow.layout import KVLayout
from kvflow.pipeline.addrgen import BatchAddresses, LayerRanges
from kvflow.pipeline.executor import PinnedExecutor
from kvflow.stores.arena import SLOT_ALIGN
from kvflow.stores.base import Direction, Store, WriteSession
from kvflow.stores.local import LocalStore

__all__ = [
    "CHUNK_BLOCKS",
    "DIRECTIONS",
    "LOOPS",
    "KiB",
    "MAX_TRANSFER_BYTES",
    "MiB",
    "CopyBench",
    "Memcpy",
    "best_times",
    "check_output_path",
    "count",
    "cpu_list",
    "figure",
    "fmt_bytes",
    "format_axes",
    "fraction",
    "gc_paused",
    "int_list",
    "load_average",
    "log_axis",
    "pick",
    "pin_cpus",
    "save",
    "size_arg",
    "size_list",
    "small_layout",
    "store_for",
    "submit_copy",
]

KiB = 1 << 10
MiB = 1 << 20
CHUNK_BLOCKS = 16
MAX_TRANSFER_BYTES = EngineConfig().transfer_limit
DIRECTIONS = (("to_pool", Direction.TO_POOL), ("from_pool", Direction.FROM_POOL))
LOOPS = ("native", "python")  # LocalStore's copy loops: native_copy=True, native_copy=False


# -- arguments and formatting ---------------------------------------------------------------


def count(text: str) -> int:
    """``"16"`` -> ``16``: an integer >= 1 (argparse ``type``)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def fraction(text: str) -> float:
    """``"0.9"`` -> ``0.9``: a number strictly between 0 and 1 (argparse ``type``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def size_arg(text: str) -> int:
    """``"64MiB"`` -> ``67108864`` (argparse ``type``)."""
    try:
        return parse_size(text.strip(), argument="size")
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 64MiB or 4096, got {text!r}"
        ) from None


def size_list(text: str) -> list[int]:
    """``"4KiB,1MiB"`` -> ``[4096, 1048576]`` (argparse ``type``)."""
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    try:
        if sizes:
            return [parse_size(s, argument="size") for s in sizes]
    except ConfigError:
        pass
    raise argparse.ArgumentTypeError(
        f"expected comma-separated sizes such as 4KiB,1MiB, got {text!r}"
    )


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: integers >= 1 (argparse ``type``)."""
    values = [s.strip() for s in text.split(",") if s.strip()]
    if not values or not all(v.isdigit() and int(v) >= 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 such as 1,2,4, got {text!r}"
        )
    return [int(v) for v in values]


def check_output_path(path: str, option: str) -> None:
    """Before a run, refuse an output file (``--json``, ``--plot``) that could not be written
    after it: its folder is created, as writing it would, and must be writable, and the path
    must not be a folder. Raises ConfigError naming ``option``."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocked = isinstance(exc, (FileExistsError, NotADirectoryError))
        why = "a file is in the way" if blocked else exc.strerror
        raise ConfigError(
            option, path, f"cannot create its folder {target.parent}: {why}"
        ) from None
    if target.is_dir():
        raise ConfigError(option, path, "is a folder; give a file name")
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        raise ConfigError(option, path, "cannot be written (permissions or a read-only folder)")


def pick(value: Any, quick: bool, full: Any, small: Any) -> Any:
    """An option's value if given, else the quick or the full default."""
    if value is not None:
        return value
    return small if quick else full


def fmt_bytes(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def pin_cpus(threads: int) -> tuple[int, ...]:
    """The last ``threads`` CPUs this process may run on: where pinned copy threads go."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return ()
    return tuple(cpus[-threads:])


# -- timing ---------------------------------------------------------------------------------


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (a collection would be timed)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def best_times(fns: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1) -> list[float]:
    """Best wall-clock seconds of each function over ``repeats`` rounds, the functions timed in
    turn inside every round, after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    with gc_paused():
        for _ in range(max(repeats, 1)):
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - start)
    return best


# -- stores ---------------------------------------------------------------------------------


def store_for(layout: KVLayout, chunk_blocks: int, objects: int, **kw: Any) -> LocalStore:
    """A LocalStore with room for ``objects`` chunk objects of ``layout`` (and one spare)."""
    slot = -(-layout.object_bytes(chunk_blocks) // SLOT_ALIGN) * SLOT_ALIGN
    return LocalStore((objects + 1) * slot, **kw)


def small_layout(
    layers: int, blocks: int, block_bytes: int, seed: int = 0
) -> tuple[list[torch.Tensor], KVLayout]:
    """``layers`` random ``uint8 [blocks, block_bytes]`` tensors and their layout (16 tokens
    per block)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(0, 256, (blocks, block_bytes), generator=gen, dtype=torch.uint8)
        for _ in range(layers)
    ]
    return tensors, KVLayout.from_tensors(tensors, block_size=16)


# -- copies ---------------------------------------------------------------------------------


class Memcpy:
    """The memcpy reference: one ``numpy.copyto`` of ``nbytes`` between two buffers whose pages
    are already mapped."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.full(nbytes, 7, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)

    def of(self, nbytes: int) -> Callable[[], None]:
        src, dst = self.src[:nbytes], self.dst[:nbytes]

        def copy() -> None:
            np.copyto(dst, src)

        return copy


class CopyBench:
    """A device tensor ``uint8 [n_blocks, block_bytes]`` and, for each copy loop in ``loops``
    (``"native"``, ``"python"``), a LocalStore (prefaulted, ``native_copy`` set to match)
    holding one granted object per chunk of ``chunk_blocks`` blocks: what ``batch_copy`` moves
    between. Each loop has its own pool of the same size; the device tensor is shared.

    Every block carries its id in its first and last 8 bytes, so ``verify`` catches a missing,
    misplaced or truncated block copy.
    """

    def __init__(
        self,
        block_bytes: int,
        n_blocks: int,
        chunk_blocks: int = CHUNK_BLOCKS,
        loops: Sequence[str] = ("native",),
        device: str = "cpu",
    ) -> None:
        n_blocks = max(chunk_blocks, n_blocks - n_blocks % chunk_blocks)
        self.block_bytes = block_bytes
        self.n_blocks = n_blocks
        self.nbytes = n_blocks * block_bytes
        self.chunk_blocks = chunk_blocks
        self.device = self._stamped().to(device)
        self.layout = KVLayout.from_tensors([self.device], block_size=16)
        self._pools: dict[str, tuple[LocalStore, WriteSession]] = {}
        try:
            for loop in loops:
                self._pools[loop] = self._pool(loop)
        except BaseException:
            self.close()
            raise

    def _pool(self, loop: str) -> tuple[LocalStore, WriteSession]:
        if loop not in LOOPS:
            raise ValueError(f"copy loop {loop!r}: expected one of {LOOPS}")
        n_chunks = self.n_blocks // self.chunk_blocks
        store = store_for(
            self.layout,
            self.chunk_blocks,
            n_chunks,
            prefault=True,
            native_copy=loop == "native",
            pin=self.layout.device != "cpu",  # CPU rows on a GPU machine: pageable, as ever
        )
        store.register(self.layout.regions())
        obj = self.layout.object_bytes(self.chunk_blocks)
        session = store.open_write([f"copy/{i}" for i in range(n_chunks)], obj)
        if not session.granted.all():
            store.close()
            raise RuntimeError("the copy benchmark's store did not grant every object")
        return store, session

    def _stamped(self) -> torch.Tensor:
        blocks = np.empty((self.n_blocks, self.block_bytes), dtype=np.uint8)
        blocks[:] = np.random.default_rng(0).integers(0, 256, blocks.shape[1], dtype=np.uint8)
        ids = np.arange(self.n_blocks, dtype=np.int64).view(np.uint8).reshape(-1, 8)
        blocks[:, :8] = ids
        blocks[:, -8:] = ids
        return torch.from_numpy(blocks)

    def store(self, loop: str = "native") -> LocalStore:
        """The pool of copy loop ``loop``."""
        return self._pools[loop][0]

    def ranges(self, coalesced: bool, seed: int = 0, loop: str = "native") -> LayerRanges:
        """The layer's ranges into ``loop``'s pool for block ids in order (coalesced per chunk)
        or a random permutation (one range per block)."""
        ids = (
            np.arange(self.n_blocks, dtype=np.int64)
            if coalesced
            else np.random.default_rng(seed).permutation(self.n_blocks).astype(np.int64)
        )
        addrs = BatchAddresses(
            self.layout, ids, self._pools[loop][1].addrs, self.chunk_blocks, MAX_TRANSFER_BYTES
        )
        return addrs.layer(0)

    def verify(self, ranges: LayerRanges, loop: str = "native", store: Any = None) -> None:
        """Round-trip every block through ``loop``'s pool (or ``store``, something with its
        ``batch_copy``) and check the stamps."""
        store = store or self.store(loop)
        store.batch_copy(ranges.pool, ranges.local, ranges.sizes, Direction.TO_POOL)
        self.device.zero_()
        store.batch_copy(ranges.pool, ranges.local, ranges.sizes, Direction.FROM_POOL)
        blocks = self.device.cpu().numpy()
        ids = np.arange(self.n_blocks, dtype=np.int64)
        head = np.ascontiguousarray(blocks[:, :8]).view(np.int64).reshape(-1)
        tail = np.ascontiguousarray(blocks[:, -8:]).view(np.int64).reshape(-1)
        if not (np.array_equal(head, ids) and np.array_equal(tail, ids)):
            raise RuntimeError(
                f"a round trip of {fmt_bytes(self.block_bytes)} blocks lost data ({loop} loop)"
            )

    def close(self) -> None:
        for store, session in self._pools.values():
            store.finish_write(session, np.zeros(len(session.keys), dtype=bool))
            store.close()
        self._pools.clear()


def submit_copy(
    store: Store, ranges: LayerRanges, direction: Direction, executor: PinnedExecutor
) -> Callable[[], None]:
    """A call that copies ``ranges`` on the executor's threads and waits: the ranges are cut
    into one piece per thread, of about equal bytes, each piece one ``batch_copy`` (as the
    engine's copy threads each run one layer's ``batch_copy``)."""
    ends = np.cumsum(ranges.sizes)
    total = int(ends[-1]) if ends.size else 0
    cuts = np.searchsorted(
        ends, [total * k // executor.threads for k in range(1, executor.threads)]
    )
    bounds = [0, *sorted({int(c) + 1 for c in cuts if c + 1 < len(ranges)}), len(ranges)]
    pieces = [
        (ranges.pool[a:b].copy(), ranges.local[a:b].copy(), ranges.sizes[a:b].copy())
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]

    def copy() -> None:
        futures: list[Future[np.ndarray]] = [
            executor.submit(store.batch_copy, pool, local, sizes, direction)
            for pool, local, sizes in pieces
        ]
        for future in futures:
            if future.result().size:
                raise RuntimeError("batch_copy reported failed ranges")

    return copy


# -- plots ----------------------------------------------------------------------------------


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), imported on first
    use: matplotlib is an optional dependency, needed by ``--plot`` alone."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependencyError("kvflow bench --plot", "'kvflow[plot]'") from exc
    return plt


def figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots(nrows, ncols, **kwargs)``: a new figure and its axes, on the Agg backend;
    ``MissingDependencyError`` without matplotlib."""
    fig, axes = _pyplot().subplots(nrows, ncols, **kwargs)
    return fig, axes


def save(fig: Any, path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` (the format from the suffix; folders created) and
    close it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.tight_layout()
        fig.savefig(target, dpi=dpi)
    finally:
        _pyplot().close(fig)
    return target


def log_axis(
    ax: Any,
    which: str,
    ticks: Sequence[float] | None = None,
    labels: Sequence[str] | None = None,
    base: float = 10,
) -> None:
    """A log scale on the ``which`` ("x" or "y") axis of ``ax``, labelled with plain numbers
    (``20``, not ``2 x 10^1``); with ``ticks``, exactly those ticks (labelled ``labels``,
    default the numbers), no minor ones. Call it only while plotting (it imports matplotlib)."""
    from matplotlib.ticker import LogFormatter

    getattr(ax, f"set_{which}scale")("log", base=base)
    axis = getattr(ax, f"{which}axis")
    if ticks is None:
        axis.set_major_formatter(LogFormatter(base))
        axis.set_minor_formatter(LogFormatter(base, labelOnlyBase=False))
        return
    axis.set_ticks(list(ticks), list(labels) if labels else [f"{t:g}" for t in ticks])
    axis.set_ticks([], minor=True)


def format_axes(
    axes: Iterable[Any],
    xlabel: str | None,
    xticks: Sequence[float],
    xlabels: Sequence[str] | None = None,
    *,
    base: float = 10,
    ylog: bool = True,
) -> None:
    """The scenarios' panels: a log x axis with a tick at each of ``xticks`` (see
    ``log_axis``), a log y axis unless ``ylog`` is false, ``xlabel`` and a light grid."""
    for ax in axes:
        log_axis(ax, "x", xticks, xlabels, base=base)
        if ylog:
            log_axis(ax, "y")
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, which="both")
