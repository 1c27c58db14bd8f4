"""SocketSink: records streamed to a collector over TCP from a background thread, exactly once.

What goes over the wire, and what the collector answers, is in ``protocol``: this module moves
those bytes. Every record stays buffered until the collector acknowledges it, and goes out again
after a reconnect; no wait is unbounded (a barrier's timeout, the exit deadline, ``flush_timeout``),
and the receiver thread that emits is never held longer than ``flush_timeout``.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
import time
import uuid

from hostcallback.addons import add_flush_hook, exiting

from .protocol import (
    ACK,
    HEARTBEAT,
    MAX_REFUSAL_TEXT,
    REASON,
    REFUSED,
    TOKEN_VARIABLE,
    Reason,
    Refusal,
    sender_header,
)
from .sink_base import FrameSink, process_index
from .stream import FRAME, unpack_item

logger = logging.getLogger("hostcallback.sinks")


def _unpack_name(data: bytes) -> str:
    """The name of a framed record, for a log line."""
    try:
        return str(unpack_item(data[FRAME.size:])["name"])
    except Exception:  # noqa: BLE001 (only for a message)
        return "?"


# A send that makes no progress this long means the collector is gone without a word (a network
# partition): the sink reconnects.
_SEND_TIMEOUT = 60.0
# A refusal arrives whole within this long of its first bytes (it is a sentence, sent at once):
# one that trickles in must not hold the sending thread, it is taken as far as it came.
_REFUSAL_SECONDS = 1.0
# At exit, how long the last flush waits for acknowledgements before it says what it waits for
# (as exit's own notice does for computations and queued records).
_SAY_AT_EXIT_AFTER = 3.0


class _Refused(OSError):
    """The collector hung up on purpose and said why."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.describe())
        self.refusal = refusal


class _Unacknowledged(OSError):
    """The collector took bytes but acknowledged nothing for ``ack_timeout`` s."""


class _ProtocolError(OSError):
    """The collector said what the protocol does not allow: the connection is given up, and what
    it said is believed in nothing (no record is taken for acknowledged on its word)."""


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
        add_flush_hook(self)

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
            connection.sendall(sender_header(run=self.run, process=process_index(),
                                             sender=self.sender, first=first, token=self.token))
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
                raise _Refused(self._read_refusal(connection, acks))
            raw = bytes(acks[:ACK.size])
            del acks[:ACK.size]
            with self._cond:
                newly = total - on_connection[0]
                if not 0 <= newly <= self._sent:  # it would forget records never sent
                    raise _ProtocolError(
                        f"the collector acknowledged {total} records on this connection "
                        f"(bytes {raw!r}), but {on_connection[0] + self._sent} were sent on it "
                        "(not a hostcallback collector, or a broken one; reconnecting, and no "
                        "record is forgotten)")
                on_connection[0] = total
                self._buffered -= sum(map(len, self._frames[:newly]))
                del self._frames[:newly]
                self._sent -= newly
                self.acknowledged += newly
                self._cond.notify_all()

    def _read_refusal(self, connection: socket.socket, acks: bytearray) -> Refusal:
        """The refusal that ``acks`` starts with, read whole, or as far as it came before the
        connection ended or _REFUSAL_SECONDS passed (a collector older than the codes sends no
        code, and may not hang up at once). Raises _ProtocolError for a text over
        MAX_REFUSAL_TEXT: that is no refusal to wait for."""
        deadline = time.monotonic() + _REFUSAL_SECONDS
        while len(acks) < Refusal.size_of(acks):
            if len(acks) >= ACK.size + REASON.size:
                (length,) = REASON.unpack_from(acks, ACK.size)
                if length > MAX_REFUSAL_TEXT:
                    raise _ProtocolError(
                        f"the collector sent a refusal of {length} bytes, over the "
                        f"{MAX_REFUSAL_TEXT} a refusal may have (not a hostcallback collector, "
                        "or a broken one; reconnecting)")
            try:
                connection.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = connection.recv(4096)
            except OSError:  # the deadline, or the end: what arrived is all there is
                break
            if not chunk:
                break
            acks.extend(chunk)
        return Refusal.unpack(acks)

    def _drop_too_large(self, refusal: Refusal) -> bool:
        """After a refusal RECORD_TOO_LARGE: drops the record that caused it (the oldest not
        acknowledged, as the collector acknowledges all before it) and adopts the collector's
        limit; False for any other refusal."""
        if refusal.reason is not Reason.RECORD_TOO_LARGE:
            return False
        with self._cond:
            if not self._frames:
                return False
            data = self._frames.pop(0)
            self._buffered -= len(data)
            self.acknowledged += 1  # its sequence number is skipped, never reused
            self._sent = 0
            self.dropped += 1
            if refusal.limit:  # the collector's limit, which it states with every such refusal
                self.max_record_bytes = min(self.max_record_bytes, refusal.limit)
            self._cond.notify_all()
        name = _unpack_name(data)
        logger.error("SocketSink to %s:%d: dropped record %r of %d bytes: %s; later records "
                     "go on (%d dropped so far)", *self.address, name, len(data) - FRAME.size,
                     refusal.describe(), self.dropped)
        return True

    def _report_problem(self, problem: str, refused: bool) -> None:
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
                stalled = connection is not None and isinstance(error, TimeoutError)
                if connection is not None:
                    connection.close()
                    self.reconnects += 1
                else:
                    self.connect_failures += 1
                connection = None
                refused = isinstance(error, _Refused)
                if refused and self._drop_too_large(error.refusal):
                    continue  # reconnect at once and send what follows it
                if refused or isinstance(error, (_Unacknowledged, _ProtocolError)):
                    problem = str(error)
                elif stalled:  # connected, but our records went nowhere for _SEND_TIMEOUT
                    problem = (f"the collector took no bytes for {_SEND_TIMEOUT:g} s, though "
                               "connected (short of disk, or overloaded: its log says which)")
                else:
                    problem = f"cannot reach the collector ({type(error).__name__}: {error})"
                self._report_problem(problem, refused)
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
        at most ``flush_timeout``; says once what is still unacknowledged instead of raising.
        At exit (the last flush) it says after a few seconds what it waits for, and at the end
        how many records are lost."""
        if self._closed:
            return not self.pending  # a closed sink already reported what it could not send
        at_exit = exiting()
        until = self._deadline(None, deadline)
        if at_exit and self._wait_acknowledged(min(until, time.monotonic() + _SAY_AT_EXIT_AFTER)):
            return True
        if at_exit and until > time.monotonic():
            logger.warning("SocketSink to %s:%d: exit waits up to %.0f s for the collector to "
                           "acknowledge %d records (%s)", *self.address, until - time.monotonic(),
                           self.pending, self.problem or "the collector is slow")
        if self._wait_acknowledged(until):
            return True
        if at_exit:
            logger.error("SocketSink to %s:%d: %d records the collector did not acknowledge are "
                         "lost as this process exits (%s)", *self.address, self.pending,
                         self.problem or "the collector was too slow")
            return False
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
