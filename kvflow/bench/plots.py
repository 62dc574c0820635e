"""The matplotlib boilerplate of the ``--plot`` option: a figure, its log axes, its file.
matplotlib is optional (``kvflow[plot]``) and imported only when a plot is drawn."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvflow.errors import MissingDependencyError

__all__ = ["figure", "format_axes", "log_axis", "save"]


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
