"""StatsSink: count, mean, min, max and last per series, kept as records arrive.

A series is a tap's name, or ``name.key`` for the entries of a dict value (``name[i]`` for a
tuple's); an array contributes its mean. ``scalar_series`` is the one definition of what a
record contributes, shared by the ``stats`` and ``plot`` commands. It keeps numbers only, never
the records.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .sink_base import Sink
from .stream import TapRecord


class RunningStats:
    __slots__ = ("count", "last", "maximum", "minimum", "total")

    def __init__(self) -> None:
        self.count, self.total = 0, 0.0
        self.minimum, self.maximum, self.last = math.inf, -math.inf, math.nan

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if math.isnan(value) or math.isnan(self.minimum):  # NaN, as the mean: a run diverged
            self.minimum = self.maximum = math.nan
        else:
            self.minimum = min(self.minimum, value)
            self.maximum = max(self.maximum, value)
        self.last = value

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.total / self.count if self.count else math.nan,
                "min": self.minimum, "max": self.maximum, "last": self.last}


def scalar_series(record: TapRecord) -> dict[str, float]:
    """The numbers a record contributes to per-name statistics: one per numeric leaf (its mean),
    named ``name`` or ``name.key`` for dict entries; the ``step`` entry is not a series."""
    out: dict[str, float] = {}
    _add_series(record.name, record.value, out)
    return out


def _add_series(prefix: str, value: Any, out: dict[str, float]) -> None:
    if type(value) is np.ndarray and value.ndim == 0:  # what taps deliver: one number
        if _is_series_dtype(value.dtype):
            out[prefix] = float(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "step":
                _add_series(f"{prefix}.{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _add_series(f"{prefix}[{index}]", item, out)
    else:
        array = np.asarray(value)
        if array.size and _is_series_dtype(array.dtype):
            out[prefix] = float(array.reshape(-1)[0]) if array.size == 1 else \
                float(array.astype(np.float64).mean())


_SERIES_DTYPES: dict[np.dtype, bool] = {}  # np.issubdtype costs microseconds a call


def _is_series_dtype(dtype: np.dtype) -> bool:
    """Real numbers (and the ml_dtypes floats, kind "V") make series; complex and others not."""
    known = _SERIES_DTYPES.get(dtype)
    if known is None:
        known = _SERIES_DTYPES[dtype] = (
            np.issubdtype(dtype, np.number) and not np.issubdtype(dtype, np.complexfloating)
            or dtype.kind == "V")
    return known


class StatsSink(Sink):
    """Keeps count, mean, min, max and last per series: cheap numbers for a dashboard."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, RunningStats] = {}

    def emit(self, record: TapRecord) -> None:
        with self._lock:
            for key, value in scalar_series(record).items():
                stats = self._stats.get(key)
                if stats is None:
                    stats = self._stats[key] = RunningStats()
                stats.add(value)

    def summary(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {key: stats.as_dict() for key, stats in sorted(self._stats.items())}


def format_table(summary: dict[str, dict[str, float]]) -> str:
    lines = [f"{'name':<32}{'count':>8}{'mean':>14}{'min':>14}{'max':>14}{'last':>14}"]
    for key, s in summary.items():
        lines.append(f"{key:<32}{s['count']:>8}{s['mean']:>14.6g}{s['min']:>14.6g}"
                     f"{s['max']:>14.6g}{s['last']:>14.6g}")
    return "\n".join(lines)
