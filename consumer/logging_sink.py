"""LoggingSink: one ``logging`` record per tap, large arrays summarised.

It never writes more than a line per record: arrays of more than 8 elements are written as
their statistics (dtype, shape, mean, min, max), as ``id_print`` summarises them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hostcallback.addons import array_summary

from .sink_base import Sink
from .stream import TapRecord


def summarize(value: Any, max_items: int = 8) -> str:
    """A short text for a tapped value: small arrays in full, large ones as statistics."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {summarize(v, max_items)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(summarize(v, max_items) for v in value) + ")"
    array = np.asarray(value)
    if array.size <= max_items:
        return np.array2string(array, separator=", ") if array.ndim else str(array)
    return array_summary(array)


class LoggingSink(Sink):
    """One ``logging`` record per tap, with arrays summarised."""

    def __init__(self, logger: logging.Logger | str = "hostcallback.taps",
                 level: int = logging.INFO) -> None:
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.level = level

    def emit(self, record: TapRecord) -> None:
        step = "" if record.step is None else f" step={record.step}"
        self.logger.log(self.level, "%s%s device=%s %s", record.name, step, record.device,
                        summarize(record.value))
