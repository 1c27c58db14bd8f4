"""Sinks: small objects with one job each, shaped like ``logging`` handlers.

A sink has ``emit(record)``, ``flush()`` and ``close()``. ``SinkTap`` is the tap function that turns
a tapped value into a TapRecord (name, step, device, sequence, time, ...) and hands it to its
sinks, so one tap can feed a file, a log and a dashboard at once. Sinks that write the record
stream (FileSink, SocketSink) are FrameSinks: SinkTap hands them the record's frame, packed
without a TapRecord, which is most of their speed. Writing your own sink takes five lines::

    class PrintLoss(Sink):
        def emit(self, record):
            print(record.step, record.value["loss"])
"""

from __future__ import annotations

import logging
import math
import os
import re
import select
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np

import hostcallback
from .frame_templates import FrameTemplate, make_template, step_of
from .stream import (
    ACK,
    FRAME,
    HEARTBEAT,
    REASON,
    REFUSED,
    TOKEN_VARIABLE,
    TOO_LARGE,
    RecordFramer,
    StreamWriter,
    TapRecord,
    frame_item,
    stream_header,
)
from hostcallback.batches import RecordBatch
from hostcallback.printing import array_summary
from hostcallback.receiver import receivers
from hostcallback.record_context import current_record

logger = logging.getLogger("hostcallback.sinks")


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


def _process_index() -> int:
    global _process
    if _process is None:
        import jax

        _process = jax.process_index()
    return _process


class SinkTap:
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

    def __eq__(self, other):
        return isinstance(other, SinkTap) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

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
        for sink, takes_frames in self._targets:
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

    def tap_batch(self, batch: RecordBatch) -> None:
        """The receiver's runs of records (hostcallback.batches): each FrameSink gets the
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
               tuple((leaf.dtype, leaf.shape) for leaf in batch.records[batch.start][4]))
        if key not in self._templates:
            self._templates[key] = make_template(batch, {
                "name": self.name, "metadata": dict(self.metadata),
                "process": _process_index(), "host": self._host, "device": device_name,
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
                         process=_process_index(), host=self._host, device=device_name,
                         device_id=device_id, sequence=sequence, time=now,
                         transforms=list(transforms))

    def _make_framer(self) -> RecordFramer:
        self._framer = RecordFramer(self.name, self.metadata, _process_index(), self._host)
        return self._framer

    def _device_fields(self, device) -> tuple[str, int]:
        """str(device) and its id, made once per device (str of a jax Device is not free)."""
        fields = self._devices.get(device)
        if fields is None:
            fields = self._devices[device] = (str(device), getattr(device, "id", -1))
        return fields


def tap_to(sinks: Iterable[Sink], arg: Any, *, name: str, metadata: dict[str, Any] | None = None,
           ordered: bool | None = None, device_index: int = 0, partitioned: bool = False,
           replays: str = "deliver", callback_flavor: Any = None, **unknown: Any) -> Any:
    """``id_tap`` that sends ``arg`` to ``sinks`` as a TapRecord named ``name``; returns ``arg``.

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
    return hostcallback.id_tap(SinkTap(sinks, name, **(metadata or {})), arg, ordered=ordered,
                               device_index=device_index, partitioned=partitioned,
                               replays=replays, callback_flavor=callback_flavor)


# ---- files -----------------------------------------------------------------------------------


class FileSink(FrameSink):
    """Appends records to a stream file; rotates it past ``max_bytes`` (0: never).

    Every write is whole frames (one, or a receiver's batch of them), so a crash mid-write
    leaves every earlier record readable. The file is flushed after each ``barrier_wait`` and at exit.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = 0, backup_count: int = 5) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self._lock = threading.Lock()
        self._file = None
        self._open()
        receivers.add_flush_hook(self)

    def _open(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close()
        # A header on every open: appending to an older file (even version 1) stays readable.
        self._writer = StreamWriter(self._file)

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.backup_count - 1, 0, -1):
            older = f"{self.path}.{index}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{index + 1}")
        if self.backup_count > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.remove(self.path)
        self._open()

    def emit_frame(self, data: bytes, name: str) -> None:
        with self._lock:
            if self._file is None:
                raise ValueError(f"FileSink({self.path!r}) is closed")
            if self.max_bytes and self._file.tell() + len(data) > self.max_bytes \
                    and self._file.tell() > 0:
                self._rotate()
            self._file.write(data)

    def emit_frames(self, frames: list[bytes], name: str) -> None:
        if self.max_bytes:  # rotation is decided frame by frame
            super().emit_frames(frames, name)
            return
        with self._lock:
            if self._file is None:
                raise ValueError(f"FileSink({self.path!r}) is closed")
            self._file.write(b"".join(frames))

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


# ---- logging ---------------------------------------------------------------------------------


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


# ---- running statistics ------------------------------------------------------------------------


class RunningStats:
    __slots__ = ("count", "last", "maximum", "minimum", "total")

    def __init__(self) -> None:
        self.count, self.total = 0, 0.0
        self.minimum, self.maximum, self.last = math.inf, -math.inf, math.nan

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
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


# ---- sockets ---------------------------------------------------------------------------------


def _unpack_name(data: bytes) -> str:
    """The name of a framed record, for a log line."""
    try:
        return str(msgpack.unpackb(data[FRAME.size:], raw=False, strict_map_key=False)["name"])
    except Exception:  # noqa: BLE001 (only for a message)
        return "?"


# A send that makes no progress this long means the collector is gone without a word (a network
# partition): the sink reconnects.
_SEND_TIMEOUT = 60.0


class _Refused(OSError):
    """The collector hung up on purpose and said why."""


class _Unacknowledged(OSError):
    """The collector took bytes but acknowledged nothing for ``ack_timeout`` s."""


_TOO_LARGE = re.compile(r"a record of \d+ bytes is " + re.escape(TOO_LARGE) + r" (\d+) bytes")


class SocketSink(FrameSink):
    """Streams records to a collector over TCP from a background thread, exactly once.

    Every record stays in the buffer until the collector acknowledges it; after a lost connection
    the sink reconnects with backoff and sends every unacknowledged record again, numbered, so the
    collector drops the ones it has already written ("Record stream format"). The buffer holds at
    most ``max_buffered_bytes``; when it is full, ``emit`` waits (``waits`` and ``wait_seconds``
    count it), for ``flush_timeout`` at most, then drops that record (``dropped`` counts it, and
    each drop is logged). No wait is unbounded by our own timeouts: a barrier's ``timeout``,
    HOSTCALLBACK_EXIT_TIMEOUT at exit, and ``flush_timeout`` otherwise. When the collector cannot
    be reached, or refuses the sink (a wrong token), it says so once. A record over the
    collector's ``--max-record-bytes`` is dropped (logged, counted in ``dropped``) and the sink
    adopts that limit. A collector that acknowledges nothing for ``ack_timeout`` s is left and
    reconnected to; an idle connection carries a heartbeat every ``heartbeat_seconds``.
    """

    def __init__(self, host: str, port: int, *, run: str = "run", token: str | None = None,
                 max_buffered_bytes: int = 64 << 20, max_record_bytes: int = 4 << 20,
                 connect_timeout: float = 5.0, flush_timeout: float = 30.0,
                 ack_timeout: float = 60.0, heartbeat_seconds: float = 30.0,
                 tls_ca_file: str | os.PathLike | None = None) -> None:
        self.address = (host, port)
        # TLS to a collector started with --tls-cert: its certificate must verify against this CA
        # file and name ``host``.
        self._tls = None if tls_ca_file is None else ssl.create_default_context(
            cafile=os.fspath(tls_ca_file))
        self.run = run
        self.token = token if token is not None else os.environ.get(TOKEN_VARIABLE)
        self.sender = uuid.uuid4().hex  # the collector numbers this sink's records by this id
        self.max_buffered_bytes = max_buffered_bytes
        self.max_record_bytes = max_record_bytes
        self.connect_timeout = connect_timeout
        self.flush_timeout = flush_timeout
        self.ack_timeout = ack_timeout
        self.heartbeat_seconds = heartbeat_seconds
        self.dropped = 0  # records given up on: no room in time, or too large for the collector
        self.waits = 0
        self.wait_seconds = 0.0
        self.reconnects = 0
        self.connect_failures = 0
        self.acknowledged = 0  # also the sequence number of the oldest unacknowledged record
        self.problem: str | None = None  # why the collector is not taking records, while it is not
        self._flush_warned = False
        self._last_refusal: str | None = None  # logged already in this outage
        self._frames: list[bytes] = []  # unacknowledged, oldest first; the first _sent went out
        self._sent = 0
        self._buffered = 0
        self._closed = False  # no more emits; the thread ends once everything is acknowledged
        self._abandoned = False  # the thread ends now
        self._cond = threading.Condition()
        self._connection: socket.socket | None = None  # the sending thread's, for close()
        self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"hostcallback-socket-sink-{host}:{port}")
        self._thread.start()
        receivers.add_flush_hook(self)

    @property
    def pending(self) -> int:
        """Records not acknowledged by the collector yet."""
        with self._cond:
            return len(self._frames)

    def emit_frame(self, data: bytes, name: str) -> None:
        if len(data) - FRAME.size > self.max_record_bytes:
            raise ValueError(
                f"record {name!r} is {len(data) - FRAME.size} bytes, over this SocketSink's "
                f"max_record_bytes={self.max_record_bytes} (the collector refuses records over its "
                "--max-record-bytes): tap smaller values, or raise both limits")
        with self._cond:
            if self._closed:
                raise ValueError("SocketSink is closed")
            if self._buffered and self._buffered + len(data) > self.max_buffered_bytes:
                started = time.monotonic()
                self.waits += 1
                room = self._cond.wait_for(
                    lambda: self._abandoned or not self._buffered
                    or self._buffered + len(data) <= self.max_buffered_bytes, self.flush_timeout)
                self.wait_seconds += time.monotonic() - started
                if self._abandoned:
                    raise ValueError("SocketSink is closed")
                if not room:  # the receiver thread must not stall forever: give this one up
                    self.dropped += 1
                    logger.warning("SocketSink to %s:%d: dropped record %r: no room in its "
                                   "buffer (max_buffered_bytes=%d) after flush_timeout=%s s (%s); "
                                   "%d dropped so far", *self.address, name,
                                   self.max_buffered_bytes, self.flush_timeout,
                                   self.problem or "the collector is slow", self.dropped)
                    return
            self._frames.append(data)
            self._buffered += len(data)
            self._cond.notify_all()

    def emit_frames(self, frames: list[bytes], name: str) -> None:
        """A batch joins the buffer at once, with one wake-up of the sending thread, when it
        fits whole; otherwise frame by frame, as ``emit_frame`` waits and refuses."""
        total = sum(map(len, frames))
        with self._cond:
            fits = not self._closed and (self._buffered + total <= self.max_buffered_bytes
                                         or not self._buffered and len(frames) == 1)
            if fits and max(map(len, frames), default=0) - FRAME.size <= self.max_record_bytes:
                self._frames.extend(frames)
                self._buffered += total
                self._cond.notify_all()
                return
        super().emit_frames(frames, name)

    # ---- the sending thread ----

    def _connect(self) -> socket.socket:
        connection = socket.create_connection(self.address, timeout=self.connect_timeout)
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self._tls is not None:
                connection = self._tls.wrap_socket(connection, server_hostname=self.address[0])
            connection.settimeout(_SEND_TIMEOUT)
            with self._cond:
                self._sent = 0  # send everything not acknowledged again, numbered from here
                first = self.acknowledged
            header = stream_header(run=self.run, process=_process_index(), sender=self.sender,
                                   first=first)
            if self.token:
                header["token"] = self.token
            connection.sendall(frame_item(header))
        except BaseException:
            connection.close()
            raise
        return connection

    def _take_acknowledgements(self, connection: socket.socket, acks: bytearray,
                               on_connection: list[int], wait: float) -> None:
        """Reads what acknowledgements have arrived (waiting up to ``wait`` s for the first)."""
        ended = False
        while (isinstance(connection, ssl.SSLSocket) and connection.pending()) or \
                select.select([connection], [], [], wait)[0]:
            wait = 0
            chunk = connection.recv(1 << 16)
            if not chunk:  # what arrived before the end (a refusal says why) is taken first
                ended = True
                break
            acks.extend(chunk)
        self._take_arrived(connection, acks, on_connection)
        if ended:
            raise ConnectionResetError("the collector closed the connection")

    def _take_arrived(self, connection: socket.socket, acks: bytearray,
                      on_connection: list[int]) -> None:
        while len(acks) >= ACK.size:
            (total,) = ACK.unpack_from(acks)
            if total == REFUSED:
                raise _Refused(self._refusal_reason(connection, acks))
            del acks[:ACK.size]
            with self._cond:
                newly = total - on_connection[0]
                on_connection[0] = total
                self._buffered -= sum(map(len, self._frames[:newly]))
                del self._frames[:newly]
                self._sent -= newly
                self.acknowledged += newly
                self._cond.notify_all()

    def _refusal_reason(self, connection: socket.socket, acks: bytearray) -> str:
        connection.settimeout(1.0)
        try:
            while len(acks) < ACK.size + REASON.size or len(acks) < ACK.size + REASON.size + \
                    REASON.unpack_from(acks, ACK.size)[0]:
                chunk = connection.recv(4096)
                if not chunk:
                    break
                acks.extend(chunk)
        except OSError:
            pass
        if len(acks) < ACK.size + REASON.size:
            return "the collector refused this sink"
        (length,) = REASON.unpack_from(acks, ACK.size)
        start = ACK.size + REASON.size
        return "the collector refused this sink: " + bytes(acks[start:start + length]).decode(
            "utf-8", "replace")

    def _drop_too_large(self, refusal: str) -> bool:
        """After a refusal "too large": drops the record that caused it (the oldest not
        acknowledged, as the collector acknowledges all before it) and adopts the collector's
        limit; False for any other refusal."""
        match = _TOO_LARGE.search(refusal)
        if match is None:
            return False
        with self._cond:
            if not self._frames:
                return False
            data = self._frames.pop(0)
            self._buffered -= len(data)
            self.acknowledged += 1  # its sequence number is skipped, never reused
            self._sent = 0
            self.dropped += 1
            self.max_record_bytes = min(self.max_record_bytes, int(match.group(1)))
            self._cond.notify_all()
        name = _unpack_name(data)
        logger.error("SocketSink to %s:%d: dropped record %r of %d bytes: %s; later records "
                     "go on (%d dropped so far)", *self.address, name, len(data) - FRAME.size,
                     refusal, self.dropped)
        return True

    def _report_problem(self, problem: str) -> None:
        refused = problem.startswith("the collector refused")
        with self._cond:
            # A refusal is logged once per outage, even between connection resets.
            first_time = self.problem is None if not refused else problem != self._last_refusal
            if refused:
                self._last_refusal = problem
            self.problem = problem
            self._cond.notify_all()
        if first_time:  # once per outage, not once per retry
            logger.warning("SocketSink to %s:%d: %s; %d records wait in its buffer and go out "
                           "when it takes them (retrying)", *self.address, problem, self.pending)

    def _send_loop(self) -> None:
        connection, acks, on_connection, delay = None, bytearray(), [0], 0.05
        last_sent = waiting_since = time.monotonic()  # waiting_since: for the oldest ack due
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._abandoned or self._frames or self._closed,
                                    None if connection is None else self.heartbeat_seconds)
                if self._abandoned or (self._closed and not self._frames):
                    break
                if not self._frames:  # idle: tell the collector this sink is alive
                    try:
                        connection.sendall(HEARTBEAT)
                        last_sent = time.monotonic()
                    except OSError:
                        connection.close()
                        connection = None
                    continue
                batch, size = [], 0
                for data in self._frames[self._sent:]:
                    if batch and size + len(data) > 1 << 20:
                        break
                    batch.append(data)
                    size += len(data)
            try:
                if connection is None:
                    connection = self._connection = self._connect()
                    acks, on_connection = bytearray(), [0]
                    continue  # _connect rewound what to send: gather it again
                now = time.monotonic()
                if batch:
                    connection.sendall(b"".join(batch))
                    with self._cond:
                        if not self._sent:
                            waiting_since = now
                        self._sent += len(batch)
                    last_sent = now
                elif now - last_sent >= self.heartbeat_seconds:  # waiting for acks only
                    connection.sendall(HEARTBEAT)
                    last_sent = now
                acknowledged = on_connection[0]
                self._take_acknowledgements(connection, acks, on_connection,
                                            0 if batch or connection is None else 0.05)
                if on_connection[0] != acknowledged:
                    waiting_since = time.monotonic()
                elif self._sent and time.monotonic() - waiting_since > self.ack_timeout:
                    raise _Unacknowledged(f"the collector acknowledged nothing for "
                                          f"{self.ack_timeout} s (reconnecting to send "
                                          f"{self._sent} records again)")
                if self.problem is not None and on_connection[0]:
                    logger.warning("SocketSink to %s:%d: the collector takes records again",
                                   *self.address)
                    with self._cond:
                        self.problem = None
                        self._last_refusal = None
                        self._flush_warned = False
                delay = 0.05
            except OSError as error:
                if self._abandoned:  # close() shut the socket down: it reports what was lost
                    break
                if connection is not None:
                    connection.close()
                    self.reconnects += 1
                else:
                    self.connect_failures += 1
                connection = None
                refused = isinstance(error, _Refused)
                if refused and self._drop_too_large(str(error)):
                    continue  # reconnect at once and send what follows it
                self._report_problem(str(error) if refused or isinstance(error, _Unacknowledged)
                                     else f"cannot reach the collector ({type(error).__name__}: "
                                          f"{error})")
                with self._cond:
                    self._cond.wait_for(lambda: self._abandoned, 2.0 if refused else delay)
                delay = min(delay * 2, 2.0)
        if connection is not None:
            connection.close()

    # ---- flush and close ----

    def _wait_acknowledged(self, deadline: float | None) -> bool:
        """Waits for the records emitted before this call, not for an empty buffer: other
        threads that keep emitting must not hold a flush up until its timeout."""
        with self._cond:
            emitted = self.acknowledged + len(self._frames)  # acknowledged: also those dropped
            return self._cond.wait_for(
                lambda: self.acknowledged >= emitted,
                None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _deadline(self, timeout: float | None, deadline: float | None = None) -> float:
        own = time.monotonic() + (self.flush_timeout if timeout is None else timeout)
        return own if deadline is None else min(own, deadline)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until the collector acknowledged every record emitted before this call; raises
        TimeoutError after ``timeout`` s (default ``flush_timeout``)."""
        if not self._wait_acknowledged(self._deadline(timeout)):
            raise TimeoutError(f"SocketSink to {self.address[0]}:{self.address[1]}: "
                               f"{self.pending} records not acknowledged after "
                               f"{self.flush_timeout if timeout is None else timeout} s"
                               + (f" ({self.problem})" if self.problem else ""))

    def flush_before(self, deadline: float | None) -> bool:
        """The flush after a barrier or at exit: waits until ``deadline`` (monotonic) at most, and
        at most ``flush_timeout``; says once what is still unacknowledged instead of raising."""
        if self._closed:
            return not self.pending  # a closed sink already reported what it could not send
        if self._wait_acknowledged(self._deadline(None, deadline)):
            return True
        if self._flush_warned:  # once per outage: a barrier every step must not flood the log
            return False
        self._flush_warned = True
        logger.warning("SocketSink to %s:%d: %d records not acknowledged yet (%s); they stay "
                       "buffered and go out when the collector takes them, unless this process "
                       "exits first", *self.address, self.pending,
                       self.problem or "the collector is slow")
        return False

    def close(self, timeout: float | None = None) -> int:
        """Sends what is buffered (for ``timeout`` s at most, default ``flush_timeout``), then
        stops; returns how many records the collector never acknowledged (logged as lost)."""
        deadline = self._deadline(timeout)
        self._wait_acknowledged(deadline)
        with self._cond:
            self._closed = True
            lost = len(self._frames)
            if lost:
                self._abandoned = True
            self._cond.notify_all()
        self._thread.join(max(0.1, deadline - time.monotonic()))
        connection = self._connection
        if self._thread.is_alive() and connection is not None:
            # Blocked sending to a collector that does not read (up to _SEND_TIMEOUT): shutting
            # the socket down wakes it, so no thread and socket outlive close.
            try:
                socket.socket.shutdown(connection, socket.SHUT_RDWR)
            except OSError:
                pass
            self._thread.join(1.0)
        if lost:
            logger.error("SocketSink to %s:%d closed with %d records the collector never "
                         "acknowledged; they are lost (%s)", *self.address, lost,
                         self.problem or "the collector was too slow")
        return lost
