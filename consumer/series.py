"""Scalar series per source, read from record streams: what ``plot`` draws and ``stats`` sums up.

A *series* is a name as StatsSink uses it (``train.loss``: tap name and dict key). A *source* is
where a record came from: its process and device (and, for collected streams, the host and pid
the collector tagged it with), so the curves of a pod's devices can be told apart. This module
never imports matplotlib or JAX.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from .stats_sink import scalar_series
from .stream import TapRecord
from .stream_files import expand_streams, read_stream


def source_of(record: TapRecord) -> str:
    """``host:pid/p<process>/dev<id>`` for a collected record, ``p<process>/dev<id>`` otherwise."""
    where = record.source or f"p{record.process}"
    return f"{where}/dev{record.device_id}" if record.device_id >= 0 else where


class Points(NamedTuple):
    steps: list[int]
    values: list[float]


def read_series(paths: Iterable[str | os.PathLike]) -> dict[str, dict[str, Points]]:
    """``{series: {source: Points}}`` for every scalar series in the stream files, in file order.

    A record without a step is placed at its position in its source's series.
    """
    out: dict[str, dict[str, Points]] = {}
    for path in expand_streams(paths):
        for record in read_stream(path):
            source = source_of(record)
            for name, value in scalar_series(record).items():
                points = out.setdefault(name, {}).setdefault(source, Points([], []))
                points.steps.append(record.step if record.step is not None
                                    else len(points.steps))
                points.values.append(value)
    return out


def select(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """The series named by ``patterns`` (exact names or globs such as ``train.*``), in the
    order the patterns give them, each once."""
    names = sorted(names)
    chosen: list[str] = []
    for pattern in patterns:
        matches = [pattern] if pattern in names else fnmatch.filter(names, pattern)
        chosen += [name for name in matches if name not in chosen]
    return chosen


def smooth(values: Iterable[float], weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first points
    are not pulled towards zero. ``weight`` 0 leaves the values as they are."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight {weight} must be in [0, 1)")
    values = np.asarray(list(values), dtype=np.float64)
    out = np.empty_like(values)
    average, correction = 0.0, 1.0
    for index, value in enumerate(values):
        average = weight * average + (1.0 - weight) * value
        correction *= weight
        out[index] = average / (1.0 - correction) if correction < 1.0 else value
    return out
