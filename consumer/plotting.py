"""``hostcallback-consumer plot``: line charts of scalar series from record streams (matplotlib).

One panel per series (or all in one with ``overlay``), one line per source (process/device), a
log scale and TensorBoard-style smoothing on request. matplotlib is imported only here, only
when a plot is drawn (the ``plot`` extra); it never runs on a receiver thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .cli_messages import PROG, complain
from .series import read_series, select, smooth


def draw(plt, series: dict, chosen: list[str], *, logy: bool = False, smoothing: float = 0.0,
         overlay: bool = False, title: str = ""):
    """The figure for ``plot``; returns it and how many values a log scale could not show."""
    panels = 1 if overlay else len(chosen)
    figure, axes_list = plt.subplots(panels, 1, figsize=(8, 1.2 + 2.8 * panels), sharex=True,
                                     squeeze=False)
    axes_list = axes_list[:, 0]
    skipped = 0
    for index, name in enumerate(chosen):
        axes = axes_list[0 if overlay else index]
        sources = series[name]
        for source, points in sorted(sources.items()):
            label = name if len(sources) == 1 else source
            if overlay and len(chosen) > 1:
                label = name if len(sources) == 1 else f"{name} {source}"
            steps = np.asarray(points.steps)
            values = np.asarray(points.values, dtype=np.float64)
            if logy:
                skipped += int(np.sum(values <= 0))
            if smoothing:
                (raw,) = axes.plot(steps, values, alpha=0.25, linewidth=1)
                axes.plot(steps, smooth(values, smoothing), color=raw.get_color(),
                          label=label, linewidth=1.5)
            else:
                axes.plot(steps, values, label=label, linewidth=1.5)
        if not overlay:
            axes.set_ylabel(name)
        if logy:
            axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        labels = axes.get_legend_handles_labels()[1]
        if len(labels) > 1:
            axes.legend(fontsize="small", ncol=1 + len(labels) // 9)
    axes_list[-1].set_xlabel("step")
    heading = title or ", ".join(chosen)
    if smoothing:
        heading += f"  (smoothed {smoothing:g})"
    axes_list[0].set_title(heading)
    figure.tight_layout()
    return figure, skipped


def plot(paths: str | os.PathLike | Sequence[str | os.PathLike],
         names: str | Sequence[str], output: str | os.PathLike, *, logy: bool = False,
         smoothing: float = 0.0, overlay: bool = False, title: str | None = None) -> int:
    """Draws ``names`` (series names or globs) from the stream files into ``output`` (PNG, SVG,
    PDF by its suffix). Returns 0, or 1 after saying on stderr what was missing; 2 without
    matplotlib."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    names = [names] if isinstance(names, str) else list(names)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        complain("plot", "needs matplotlib: pip install 'hostcallback[plot]'")
        return 2
    series = read_series(paths)
    chosen = select(series, names)
    shown = " ".join(map(str, paths))
    if not chosen:
        missing = ", ".join(repr(n) for n in names)
        complain("plot", f"no series named {missing} in {shown}; `{PROG} stats {shown}` lists "
                 "them")
        return 1
    if not title and not overlay and len(chosen) > 1:
        title = os.path.basename(os.fspath(paths[0]))  # each panel names its series
    figure, skipped = draw(plt, series, chosen, logy=logy, smoothing=smoothing, overlay=overlay,
                           title=title or "")
    try:
        figure.savefig(output, dpi=100)
    except ValueError as error:  # an image format matplotlib does not write
        formats = ", ".join(sorted(figure.canvas.get_supported_filetypes()))
        complain("plot", f"cannot write {output}: {error}; use one of these suffixes: {formats}")
        return 1
    finally:
        plt.close(figure)
    if skipped:
        complain("plot", f"{skipped} values <= 0 cannot be shown on a log scale and were left out")
    return 0
