"""Sinks: small objects with one job each, shaped like ``logging`` handlers.

A sink has ``emit(record)``, ``flush()`` and ``close()``. ``SinkTap`` is the tap function that turns
a tapped value into a TapRecord (name, step, device, sequence, time, ...) and hands it to its
sinks, so one tap can feed a file, a log and a dashboard at once. Writing your own sink takes five
lines::

    class PrintLoss(Sink):
        def emit(self, record):
            print(record.step, record.value["loss"])
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

import hostcallback
from consumer.stream import ACK, StreamWriter, TapRecord, pack, stream_header
from hostcallback.receiver import receivers


class Sink:
    """Receives TapRecords. Subclasses override emit; flush and close are optional."""

    def emit(self, record: TapRecord) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


def _process_index() -> int:
    import jax

    return jax.process_index()


class SinkTap:
    """The tap function behind ``tap_to``: one TapRecord per tap, to every sink.

    Equal SinkTaps (same sinks, name and metadata) are one consumer, so retracing reuses it.
    """

    def __init__(self, sinks: Iterable[Sink], name: str, **metadata: Any) -> None:
        self.sinks = tuple(sinks)
        self.name = name
        self.metadata = metadata
        self._host = socket.gethostname()

    def _key(self):
        return (tuple(map(id, self.sinks)), self.name, repr(sorted(self.metadata.items())))

    def __eq__(self, other):
        return isinstance(other, SinkTap) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __call__(self, arg, transforms, device=None) -> None:
        context = hostcallback.current_record()
        step = arg.get("step") if isinstance(arg, dict) else None
        record = TapRecord(
            name=self.name, value=arg, metadata=dict(self.metadata),
            step=None if step is None else int(np.asarray(step).reshape(-1)[0]),
            process=_process_index(), host=self._host,
            device=str(context.device) if context else "",
            device_id=getattr(context.device, "id", -1) if context else -1,
            sequence=context.sequence if context else -1, time=time.time(),
            transforms=list(transforms))
        for sink in self.sinks:
            sink.emit(record)


def tap_to(sinks: Iterable[Sink], arg: Any, *, name: str, ordered: bool | None = None,
           **metadata: Any) -> Any:
    """``id_tap`` that sends ``arg`` to ``sinks`` as a TapRecord named ``name``; returns ``arg``.

    A dict ``arg`` with a ``"step"`` entry gives the record its step.
    """
    return hostcallback.id_tap(SinkTap(sinks, name, **metadata), arg, ordered=ordered)


# ---- files -----------------------------------------------------------------------------------


class FileSink(Sink):
    """Appends records to a stream file; rotates it past ``max_bytes`` (0: never).

    Every write is one complete msgpack record, so a crash mid-write leaves every earlier record
    readable. The file is flushed after each ``barrier_wait`` and at exit.
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
        fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self._file = open(self.path, "ab")
        self._writer = StreamWriter(self._file, write_header=fresh)

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

    def emit(self, record: TapRecord) -> None:
        data = pack(record.to_map())
        with self._lock:
            if self._file is None:
                raise ValueError(f"FileSink({self.path!r}) is closed")
            if self.max_bytes and self._file.tell() + len(data) > self.max_bytes \
                    and self._file.tell() > 0:
                self._rotate()
            self._file.write(data)

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
    if np.issubdtype(array.dtype, np.number) and not np.iscomplexobj(array):
        as_float = array.astype(np.float64)
        return (f"{array.dtype}{list(array.shape)} mean={as_float.mean():.6g} "
                f"min={as_float.min():.6g} max={as_float.max():.6g}")
    return f"{array.dtype}{list(array.shape)}"


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

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key != "step":
                    visit(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(f"{prefix}[{index}]", item)
        else:
            array = np.asarray(value)
            if array.size and np.issubdtype(array.dtype, np.number) \
                    and not np.iscomplexobj(array) or array.size and array.dtype.kind == "V":
                out[prefix] = float(array.astype(np.float64).mean())

    visit(record.name, record.value)
    return out


class StatsSink(Sink):
    """Keeps count, mean, min, max and last per series: cheap numbers for a dashboard."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, RunningStats] = {}

    def emit(self, record: TapRecord) -> None:
        with self._lock:
            for key, value in scalar_series(record).items():
                self._stats.setdefault(key, RunningStats()).add(value)

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


class SocketSink(Sink):
    """Streams records to a collector over TCP from a background thread, at least once.

    Every record stays in the buffer until the collector acknowledges it; after a lost connection
    the sink reconnects with backoff and sends every unacknowledged record again (the collector may
    then see a record twice, never zero times). The buffer holds at most ``max_buffered_bytes``;
    when it is full, ``emit`` waits (``waits`` and ``wait_seconds`` count it) rather than dropping.
    """

    def __init__(self, host: str, port: int, *, run: str = "run",
                 max_buffered_bytes: int = 64 << 20, connect_timeout: float = 5.0) -> None:
        self.address = (host, port)
        self.run = run
        self.max_buffered_bytes = max_buffered_bytes
        self.connect_timeout = connect_timeout
        self.waits = 0
        self.wait_seconds = 0.0
        self.reconnects = 0
        self.acknowledged = 0
        self._unacknowledged: list[bytes] = []  # oldest first; the first _sent went out already
        self._sent = 0
        self._buffered = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"hostcallback-socket-sink-{host}:{port}")
        self._thread.start()
        receivers.add_flush_hook(self)

    def emit(self, record: TapRecord) -> None:
        data = pack(record.to_map())
        with self._cond:
            if self._closed:
                raise ValueError("SocketSink is closed")
            if self._buffered and self._buffered + len(data) > self.max_buffered_bytes:
                started = time.monotonic()
                self.waits += 1
                self._cond.wait_for(lambda: self._closed or not self._buffered
                                    or self._buffered + len(data) <= self.max_buffered_bytes)
                self.wait_seconds += time.monotonic() - started
            self._unacknowledged.append(data)
            self._buffered += len(data)
            self._cond.notify_all()

    def _connect(self) -> socket.socket | None:
        delay = 0.05
        while True:
            with self._cond:
                if self._closed and not self._unacknowledged:
                    return None
            try:
                connection = socket.create_connection(self.address, timeout=self.connect_timeout)
                connection.settimeout(None)
                connection.sendall(pack(stream_header(run=self.run, process=_process_index())))
                return connection
            except OSError:
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _take_acknowledgements(self, connection, acks: bytearray, on_connection: list[int]) -> bool:
        """Reads what acknowledgements have arrived; False when the collector hung up."""
        while select.select([connection], [], [], 0)[0]:
            chunk = connection.recv(4096)
            if not chunk:
                return False
            acks.extend(chunk)
        while len(acks) >= ACK.size:
            (total,) = ACK.unpack_from(acks)
            del acks[:ACK.size]
            with self._cond:
                newly = total - on_connection[0]
                on_connection[0] = total
                done = self._unacknowledged[:newly]
                del self._unacknowledged[:newly]
                self._sent -= newly
                self._buffered -= sum(map(len, done))
                self.acknowledged += newly
                self._cond.notify_all()
        return True

    def _send_loop(self) -> None:
        connection, acks, on_connection = None, bytearray(), [0]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._sent < len(self._unacknowledged)
                                    or self._closed or self._unacknowledged, timeout=0.05)
                if self._closed and not self._unacknowledged:
                    break
                data = (self._unacknowledged[self._sent]
                        if self._sent < len(self._unacknowledged) else None)
            try:
                if connection is None:
                    connection = self._connect()
                    if connection is None:
                        break
                    acks, on_connection = bytearray(), [0]
                if data is not None:
                    connection.sendall(data)
                    with self._cond:
                        self._sent += 1
                if not self._take_acknowledgements(connection, acks, on_connection):
                    raise ConnectionResetError("the collector closed the connection")
            except OSError:
                if connection is not None:
                    connection.close()
                connection = None
                with self._cond:
                    self._sent = 0  # send everything not acknowledged again
                self.reconnects += 1
        if connection is not None:
            connection.close()

    def flush(self, timeout: float | None = 30.0) -> None:
        """Waits until the collector acknowledged every emitted record."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._unacknowledged, timeout):
                raise TimeoutError(f"SocketSink to {self.address}: {len(self._unacknowledged)} "
                                   f"records not acknowledged after {timeout} s")

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(10)
