"""The sink seam: the Sink base classes, and the tap function that feeds sinks (``tap_to``).

A sink has ``emit(record)``, ``flush()`` and ``close()``, as a ``logging`` handler has. ``SinkTap``
is the tap function that turns a tapped value into a TapRecord (name, step, device, sequence,
time, ...) and hands it to its sinks, so one tap can feed a file, a log and a dashboard at once.
Sinks that write the record stream (FileSink, SocketSink) are FrameSinks: SinkTap hands them the
record's frame, packed without a TapRecord, which is most of their speed. Writing your own sink
takes five lines::

    class PrintLoss(Sink):
        def emit(self, record):
            print(record.step, record.value["loss"])

The sinks themselves live one per module beside this one. Like every consumer module, this one
uses nothing of hostcallback but its public API and ``hostcallback.addons``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from typing import Any

import hostcallback
from hostcallback.addons import LEAVES, EqualByKey, RecordBatch, current_record

from .frame_templates import FrameTemplate, make_template, step_of
from .record_framer import RecordFramer
from .stream import TapRecord, frame_item


class Sink:
    """Receives TapRecords. Subclasses override emit; flush and close are optional."""

    def emit(self, record: TapRecord) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


class FrameSink(Sink):
    """A sink that writes records as stream frames. ``SinkTap`` calls ``emit_frame`` with the
    frame it packed for all such sinks at once (unless a subclass overrides ``emit``)."""

    def emit(self, record: TapRecord) -> None:
        self.emit_frame(frame_item(record.to_map()), record.name)

    def emit_frame(self, data: bytes, name: str) -> None:
        """Writes one framed record; ``name`` is the record's, for messages."""
        raise NotImplementedError

    def emit_frames(self, frames: list[bytes], name: str) -> None:
        """Writes several framed records of one tap site, in order (a receiver's batch); a
        frame that fails does not keep the later ones out, and the first error is raised."""
        first_error = None
        for data in frames:
            try:
                self.emit_frame(data, name)
            except Exception as error:  # noqa: BLE001 - raised after the rest
                first_error = first_error or error
        if first_error is not None:
            raise first_error


def _takes_frames(sink: Sink) -> bool:
    return isinstance(sink, FrameSink) and type(sink).emit is FrameSink.emit


_process = None  # this process's index, asked of jax once: by the first record, jax is set up


def process_index() -> int:
    """``jax.process_index()``, asked once (by the first record, jax is set up)."""
    global _process
    if _process is None:
        import jax

        _process = jax.process_index()
    return _process


class SinkTap(EqualByKey):
    """The tap function behind ``tap_to``: one record per tap, to every sink. FrameSinks get it
    as a frame packed by a RecordFramer (byte for byte the frame of the TapRecord), the others
    as a TapRecord; each form is built once per tap, and only if a sink takes it.

    Equal SinkTaps (same sinks, name and metadata) are one consumer, so retracing reuses it.
    """

    def __init__(self, sinks: Iterable[Sink], name: str, **metadata: Any) -> None:
        self.sinks = tuple(sinks)
        self.name = name
        self.metadata = metadata
        self._host = socket.gethostname()
        self._devices: dict[Any, tuple[str, int]] = {}
        self._targets = tuple((sink, _takes_frames(sink)) for sink in self.sinks)
        self._frame_sinks = tuple(sink for sink, frames in self._targets if frames)
        self._record_sinks = tuple(sink for sink, frames in self._targets if not frames)
        self._framer: RecordFramer | None = None  # built by the first record (process index)
        # (consumer id, device, dtypes and shapes) -> its FrameTemplate, or None: framed in Python
        self._templates: dict[tuple, FrameTemplate | None] = {}

    def _key(self):
        return (tuple(map(id, self.sinks)), self.name, repr(sorted(self.metadata.items())))

    def __repr__(self) -> str:  # how failures name this tap site
        return f"tap_to({self.name!r}) to [{', '.join(map(repr, self.sinks))}]"

    def __call__(self, arg, transforms, device=None) -> None:
        context = current_record()
        step = step_of(arg)
        if context is None:
            device_name, device_id, sequence = "", -1, -1
        else:
            device_name, device_id = self._device_fields(context.device)
            sequence = context.sequence
        now = time.time()
        data = record = None  # each built once, for the first sink that wants it
        first_error = None  # a sink that fails does not keep the others from the record
        for sink, takes_frames in self._targets:
            try:
                if takes_frames:
                    if data is None:
                        framer = self._framer or self._make_framer()
                        data = framer.frame(arg, step, device_name, device_id, sequence, now,
                                            transforms)
                    sink.emit_frame(data, self.name)
                else:
                    if record is None:
                        record = self._record(arg, step, device_name, device_id, sequence, now,
                                              transforms)
                    sink.emit(record)
            except Exception as error:  # noqa: BLE001 - raised once the others have it
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def tap_batch(self, batch: RecordBatch) -> None:
        """The receiver's runs of records (RecordBatch): each FrameSink gets the
        run's frames in one call, put together in C++ where the tap site has a FrameTemplate;
        the other sinks get a TapRecord per record, as from a call per record."""
        device_name, device_id = self._device_fields(batch.device)
        first_error = None  # a sink that fails does not keep the others from the batch
        if self._frame_sinks:
            frames = self._frames(batch, device_name, device_id)
            for sink in self._frame_sinks:
                try:
                    sink.emit_frames(frames, self.name)
                except Exception as error:  # noqa: BLE001 - raised once the others have it
                    first_error = first_error or error
        if self._record_sinks:
            transforms = batch.transforms
            for value, sequence in zip(batch.values(), batch.sequences()):
                record = self._record(value, step_of(value), device_name, device_id, sequence,
                                      time.time(), transforms)
                for sink in self._record_sinks:
                    try:
                        sink.emit(record)
                    except Exception as error:  # noqa: BLE001 - raised once the others have it
                        first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _frames(self, batch: RecordBatch, device_name: str, device_id: int) -> list[bytes]:
        # One tap function may be traced for values of several dtypes and shapes (one consumer
        # id): a template per device and per dtypes and shapes of the run's first record.
        key = (batch.consumer_id, batch.device,
               tuple((leaf.dtype, leaf.shape)
                     for leaf in batch.records[batch.start][LEAVES]))
        if key not in self._templates:
            self._templates[key] = make_template(batch, {
                "name": self.name, "metadata": dict(self.metadata),
                "process": process_index(), "host": self._host, "device": device_name,
                "device_id": device_id})
        template = self._templates[key]
        if template is not None:
            try:
                return template.frames(batch)
            except ValueError:  # a record of other dtypes or shapes later in the run
                pass  # framed in Python below, as every record the template does not describe
        framer = self._framer or self._make_framer()
        transforms = batch.transforms
        return [framer.frame(value, step_of(value), device_name, device_id, sequence,
                             time.time(), transforms)
                for value, sequence in zip(batch.values(), batch.sequences())]

    def _record(self, value, step, device_name, device_id, sequence, now,
                transforms) -> TapRecord:
        return TapRecord(name=self.name, value=value, metadata=dict(self.metadata), step=step,
                         process=process_index(), host=self._host, device=device_name,
                         device_id=device_id, sequence=sequence, time=now,
                         transforms=list(transforms))

    def _make_framer(self) -> RecordFramer:
        self._framer = RecordFramer(self.name, self.metadata, process_index(), self._host)
        return self._framer

    def _device_fields(self, device) -> tuple[str, int]:
        """str(device) and its id, made once per device (str of a jax Device is not free)."""
        fields = self._devices.get(device)
        if fields is None:
            fields = self._devices[device] = (str(device), getattr(device, "id", -1))
        return fields


def _checked_sinks(sinks: Any) -> tuple[Sink, ...]:
    """``sinks`` as a tuple, or a TypeError that says what was given: found when the tap is
    traced, not by the receiver at the first record."""
    if isinstance(sinks, (str, bytes, os.PathLike)):
        raise TypeError(f"tap_to() takes sinks, not a path ({sinks!r}): "
                        f"tap_to([FileSink({sinks!r})], x, name=...)")
    if hasattr(sinks, "emit") and not isinstance(sinks, type):
        return (sinks,)
    try:
        found = (sinks,) if isinstance(sinks, type) else tuple(sinks)
    except TypeError:
        raise TypeError(f"tap_to() takes a list of sinks (objects with an emit method); got "
                        f"{type(sinks).__name__}") from None
    for sink in found:
        if isinstance(sink, type):
            raise TypeError(f"tap_to() takes sinks, not the class {sink.__name__}: make one, "
                            f"as in tap_to([{sink.__name__}(...)], x, name=...)")
        if not hasattr(sink, "emit"):
            raise TypeError(f"tap_to() takes sinks (objects with an emit method, such as "
                            f"FileSink or StatsSink); got {type(sink).__name__} {sink!r:.60}")
    return found


def tap_to(sinks: Iterable[Sink] | Sink, arg: Any, *, name: str,
           metadata: dict[str, Any] | None = None, ordered: bool | None = None,
           device_index: int = 0, partitioned: bool = False, replays: str = "deliver",
           callback_flavor: Any = None, **unknown: Any) -> Any:
    """``id_tap`` that sends ``arg`` to ``sinks`` (a list of sinks, or one sink) as a TapRecord
    named ``name``; returns ``arg``.

    A dict ``arg`` with a ``"step"`` entry gives the record its step; ``metadata`` is stored with
    every record. The other keywords are ``id_tap``'s (``partitioned=True``: a record per shard
    from every device of a sharded jit); any other keyword is refused.
    """
    if unknown:
        raise TypeError(
            f"tap_to() got unexpected keyword argument(s) {', '.join(sorted(unknown))}. It takes "
            "id_tap's options (ordered, device_index, partitioned, replays, callback_flavor) by "
            "name, and metadata for the records as metadata={...}, e.g. "
            f"tap_to(sinks, x, name={name!r}, metadata={{{next(iter(sorted(unknown)))!r}: ...}})")
    sinks = _checked_sinks(sinks)
    if not isinstance(name, str):
        raise TypeError(f"tap_to() takes the records' name as a str, not {type(name).__name__}: "
                        "tap_to(sinks, x, name='loss')")
    return hostcallback.id_tap(SinkTap(sinks, name, **(metadata or {})), arg, ordered=ordered,
                               device_index=device_index, partitioned=partitioned,
                               replays=replays, callback_flavor=callback_flavor)
