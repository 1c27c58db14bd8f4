"""TensorBoardSink: taps as TensorBoard scalars and histograms, through tensorboardX.

Each numeric leaf of a tapped pytree becomes a series tagged ``<tap name>/<path>`` (dict keys and
list indices joined by ``/``, e.g. ``train/loss``, ``train/grads/w1``). A scalar, or an array
without a histogram asked for, is written as a scalar (an array as its mean, as StatsSink does);
an array whose tag matches ``histograms`` is written as a histogram. The step is the record's
step (the ``step`` leaf), else a counter per series. Event files are flushed at every
``barrier_wait`` and at exit.

Every process writes its own event file (``...p<process>.<pid>.<n>``) into the shared log directory,
so the processes of a pod never write the same file and TensorBoard merges them as one run.
tensorboardX (no TensorFlow) is needed only once a sink is made: the ``tensorboard`` extra.
``read_events`` reads event files back with tensorboardX's own protobuf, for tests and tools.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from hostcallback.addons import add_flush_hook

from .sink_base import Sink
from .stream import TapRecord

logger = logging.getLogger("hostcallback.tensorboard")


def _tensorboardx():
    try:
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
    except ImportError as error:
        raise ImportError("TensorBoardSink needs tensorboardX: pip install "
                          "'hostcallback[tensorboard]'") from error
    return summary, EventsWriter, Event


_serial = itertools.count()


def tensorboard_leaves(name: str, value: Any) -> Iterator[tuple[str, np.ndarray]]:
    """(tag, numeric array) for each leaf worth plotting; the top-level ``step`` is the step."""

    def visit(tag: str, item: Any, top: bool) -> Iterator[tuple[str, np.ndarray]]:
        if isinstance(item, dict):
            for key, child in item.items():
                if not (top and key == "step"):
                    yield from visit(f"{tag}/{key}", child, False)
        elif isinstance(item, (list, tuple)):
            for index, child in enumerate(item):
                yield from visit(f"{tag}/{index}", child, False)
        else:
            array = np.asarray(item)
            if array.size and (np.issubdtype(array.dtype, np.number) or array.dtype == bool
                               or array.dtype.kind == "V") and not np.iscomplexobj(array):
                yield tag, array

    yield from visit(name, value, True)


class TensorBoardSink(Sink):
    """Writes taps to a TensorBoard log directory (event files, one per process and sink).

    ``histograms``: glob patterns of tags whose arrays are written as histograms (``"*"`` for
    every array), e.g. ``("train/grads/*",)``; ``histogram_bins`` caps their bin count.
    ``per_device``: each device's records go to a run of their own, ``logdir/dev<id>``, which
    TensorBoard draws as one line per device in the same chart (under ``pmap`` or ``shard_map``
    every device taps the same tags); by default all devices share one series.
    """

    def __init__(self, logdir: str | os.PathLike, *, histograms: Iterable[str] = (),
                 histogram_bins: int = 64, per_device: bool = False) -> None:
        if isinstance(histograms, str):
            histograms = (histograms,)
        self.logdir = os.fspath(logdir)
        self.histograms = tuple(histograms)
        self.histogram_bins = histogram_bins
        self.per_device = per_device
        # Fail now, not on a receiver thread.
        self._summary, self._events_writer, self._event = _tensorboardx()
        self._lock = threading.Lock()
        self._writers: dict[str, Any] = {}
        self._counters: dict[tuple[str, str], int] = {}
        self._closed = False
        add_flush_hook(self)

    def _writer_for(self, record: TapRecord):
        run = f"dev{record.device_id}" if self.per_device and record.device_id >= 0 else ""
        writer = self._writers.get(run)
        if writer is None:
            # Opened at the first record, so the process index comes from the record and
            # building a sink never starts JAX's backends (jax.distributed.initialize comes
            # first). tensorboardX's SummaryWriter is not used: it queues events for a thread of
            # its own and its flush() does not wait for them; the receiver thread that calls
            # emit is already off the device's path, so events are written here, in order.
            directory = os.path.join(self.logdir, run)
            os.makedirs(directory, exist_ok=True)
            suffix = f".p{record.process}.{os.getpid()}.{next(_serial)}"
            writer = self._events_writer(os.path.join(directory, "events"), suffix)
            self._writers[run] = writer
        return run, writer

    def _is_histogram(self, tag: str, array: np.ndarray) -> bool:
        return array.size > 1 and any(fnmatch.fnmatchcase(tag, p) for p in self.histograms)

    def emit(self, record: TapRecord) -> None:
        with self._lock:
            if self._closed:
                raise ValueError(f"TensorBoardSink({self.logdir!r}) is closed")
            run, writer = self._writer_for(record)
            for tag, array in tensorboard_leaves(record.name, record.value):
                if record.step is not None:
                    step = record.step
                else:
                    step = self._counters.get((run, tag), 0)
                    self._counters[run, tag] = step + 1
                values = array.astype(np.float64)
                if self._is_histogram(tag, array):
                    values = values.reshape(-1)
                    finite = np.isfinite(values)
                    if not finite.all():  # a diverging run: keep what can be drawn, and say so
                        logger.warning("TensorBoardSink: %s at step %d: %d non-finite values "
                                       "(NaN or Inf) left out of its histogram", tag, step,
                                       int(values.size - finite.sum()))
                        values = values[finite]
                        if not values.size:
                            continue
                    summary = self._summary.histogram(tag, values, "auto",
                                                      max_bins=self.histogram_bins)
                else:
                    summary = self._summary.scalar(tag, float(values.mean()))
                writer.write_event(self._event(summary=summary, step=step,
                                               wall_time=record.time or time.time()))

    def flush(self) -> None:
        """Puts every event so far on disk (called at every barrier_wait and at exit)."""
        with self._lock:
            if not self._closed:
                for writer in self._writers.values():
                    writer.flush()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                for writer in self._writers.values():
                    writer.close()
            self._closed = True


def event_files(logdir: str | os.PathLike) -> list[str]:
    """The event files under ``logdir``, oldest name first."""
    found = []
    for directory, _, names in os.walk(logdir):
        found += [os.path.join(directory, n) for n in names if "tfevents" in n]
    return sorted(found)


def read_events(path: str | os.PathLike) -> Iterator[Any]:
    """The ``Event`` protos of one event file (TFRecord framing; checksums not checked)."""
    from tensorboardX.proto.event_pb2 import Event

    with open(path, "rb") as file:
        while True:
            header = file.read(12)  # uint64 length, uint32 masked crc of the length
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            data = file.read(length)
            file.read(4)  # masked crc of the data
            if len(data) < length:
                return  # a torn last event
            event = Event()
            event.ParseFromString(data)
            yield event


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``logdir`` as ``{tag: [(step, value), ...]}``, in file order."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in event_files(logdir):
        for event in read_events(path):
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
