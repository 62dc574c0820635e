"""Output of the benchmarks: tables, a progress bar, machine facts, JSON files."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from kvflow.cpus import affinity

__all__ = ["Report", "machine_info"]


class Report:
    """Where a scenario writes: tables to ``out``, progress and notes to ``err``."""

    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.out = out
        self.err = err

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Print an aligned table; floats keep the precision they were formatted with."""
        cells = [[_cell(v) for v in row] for row in rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print(f"\n{title}", file=self.out)
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)), file=self.out)
        print("  ".join("-" * w for w in widths), file=self.out)
        for row in cells:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)), file=self.out)
        self.out.flush()

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    @contextmanager
    def progress(self, total: int, label: str) -> Iterator[_Progress]:
        bar = _Progress(total, label, self.err)
        try:
            yield bar
        finally:
            bar.close()


class _Progress:
    """A one-line progress bar on a terminal; a line every few seconds elsewhere."""

    def __init__(self, total: int, label: str, stream: TextIO) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream
        self.done = 0
        self.tty = stream.isatty()
        self.start = self.last = time.monotonic()

    def step(self, what: str = "") -> None:
        self.done += 1
        now = time.monotonic()
        if self.tty:
            filled = int(30 * self.done / self.total)
            print(
                f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done}/{self.total} {what:<30.30}",
                end="",
                file=self.stream,
                flush=True,
            )
        elif now - self.last >= 5 or self.done == self.total:
            self.last = now
            print(f"{self.label}: {self.done}/{self.total} {what}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            elapsed = time.monotonic() - self.start
            print(
                f"\r{self.label}: {self.done}/{self.total} in {elapsed:.1f} s{' ' * 40}",
                file=self.stream,
                flush=True,
            )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def machine_info() -> dict[str, Any]:
    """Facts that explain the figures: CPU, cores, versions, load."""
    import numpy
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": affinity() or None,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "glibc": " ".join(platform.libc_ver()),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: str | os.PathLike[str], document: dict[str, Any]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    return target
