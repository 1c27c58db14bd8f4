"""The collector: one asyncio TCP server that gathers record streams from many processes.

Each connection sends a version-2 stream (a header frame, then record frames), as SocketSink
does. The header names the ``run`` (the output file ``OUT/<run>.hcbs``, shared by every process of
that run), the sender (one id per SocketSink) and the sender's sequence number of the connection's
first record; it carries the shared token when the collector requires one. The collector copies
intact record frames into the run file without decoding them, preceded by a segment header that
names their source (``host:pid/p<process>``), sender and first sequence number; after each batch
it acknowledges the number of records received on the connection so far, so the sender can forget
them.

Exactly once: a sender resends what was not acknowledged, from its first unacknowledged record, so
the collector drops every record whose sequence number it has already written for that sender;
after a restart it rebuilds what it has written from the run file's segment headers, and cuts a
torn last frame off before it appends.

What it must never do: write a partial or unauthenticated record, buffer without bound, or let one
bad client disturb another. Limits (record size, clients, open run files, free disk, stalls, idle
clients) are in CollectorLimits; a client that breaks one is told why, logged once and dropped. An
idle sender sends heartbeats (empty frames, never written); a sender that reconnects replaces its
older connection.

What is said on the wire (the handshake, acknowledgements, refusals by their codes) is in
``protocol``, shared with SocketSink; the run files' segments and their scan after a restart are
in ``run_files``; the ``collect`` command is in ``collect_command``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import math
import os
import re
import shutil
import socket
import ssl
import threading
import time
import zlib
from typing import Any

from .protocol import (
    ACK,
    HEARTBEAT,
    TOKEN_VARIABLE,
    Reason,
    Refuse,
    check_sender_header,
    is_record,
)
from .run_files import RunFile, file_header, scan_run_file, segment_header, write_all
from .stream import FRAME, SYNC

logger = logging.getLogger("hostcallback.collector")

_SAFE_RUN = re.compile(r"[^A-Za-z0-9_.-]+")
_HEADER_BYTES = 64 << 10  # the largest header frame a client may send before it is authenticated
_READ_BYTES = 1 << 16
# The slowest a record may arrive, past the first stall_seconds: a client that sends a byte now
# and then, each within stall_seconds, must not hold a slot forever either. 64 KiB/s lets a
# 4 MiB record take a minute more.
_RECORD_BYTES_PER_SECOND = 64 << 10
# How refusals are counted (Collector.refused) and grouped in the log: several reasons, one kind.
_KINDS = {
    Reason.NOT_A_STREAM: "not a stream", Reason.NO_SENDER: "not a stream",
    Reason.VERSION: "version", Reason.TOKEN: "token",
    Reason.HEADER_TOO_LARGE: "too large", Reason.RECORD_TOO_LARGE: "too large",
    Reason.TOO_MANY_CLIENTS: "too many clients",
    Reason.NOT_A_FRAME: "garbage", Reason.BAD_CRC: "garbage", Reason.NOT_A_RECORD: "garbage",
    Reason.HEADER_STALLED: "stalled", Reason.RECORD_STALLED: "stalled",
    Reason.RECORD_TOO_SLOW: "stalled",
    Reason.ACKNOWLEDGEMENTS_UNREAD: "stalled", Reason.IDLE: "idle",
    Reason.NO_HEADER: "no header", Reason.WRITE_FAILED: "write failed",
    Reason.SHUTTING_DOWN: "closing",
}


@dataclasses.dataclass
class CollectorLimits:
    """What one collector accepts. Memory is bounded by about
    ``max_clients * (max_record_bytes + 128 KiB)`` plus a few bytes per sender seen.

    ``max_clients`` bounds the senders that sent a valid header (with the token), and apart from
    them the connections still sending one (or still in their TLS handshake, counted from the
    moment they are accepted): when those are full, the oldest is dropped for the newcomer, so
    clients that never authenticate can neither lock real senders out nor use up its files."""

    max_record_bytes: int = 4 << 20
    max_clients: int = 64
    max_open_runs: int = 32
    min_free_bytes: int = 256 << 20
    # A client silent this long mid-record is dropped, and so is one whose record has not
    # arrived whole this long after its first byte (plus a second per _RECORD_BYTES_PER_SECOND of
    # it), however it trickles in; so is one whose TLS handshake and header have not arrived whole
    # this long after it connected, and one that reads no acknowledgements this long while they
    # pile up.
    stall_seconds: float = 60.0
    # A client silent this long between records (no record, no heartbeat) is gone: a dead host
    # must not hold a slot forever. SocketSink sends a heartbeat every 30 s when it has nothing.
    idle_seconds: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_record_bytes", "max_clients", "max_open_runs"):
            _check_limit(name, getattr(self, name), minimum=1)
        _check_limit("min_free_bytes", self.min_free_bytes, minimum=0)
        for name in ("stall_seconds", "idle_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise CollectorConfigError(f"{name} (--{name.replace('_', '-')}) must be a "
                                           f"positive number of seconds, got {value!r}")


def _check_limit(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or not minimum <= value < 1 << 63:
        raise CollectorConfigError(f"{name} (--{name.replace('_', '-')}) must be a whole number "
                                   f"of at least {minimum}, got {value!r}")


class CollectorConfigError(ValueError):
    """A collector setting that would be unsafe or cannot work."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context from a certificate chain and its key (PEM files), for Collector(tls=)."""
    for name in (cert_file, key_file):
        if not os.path.isfile(name):
            raise CollectorConfigError(f"no such TLS file: {name}")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def read_token(token_file: str | None = None) -> str | None:
    """The shared token from ``token_file`` or the HOSTCALLBACK_COLLECTOR_TOKEN variable."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as file:
                token = file.read().strip()
        except UnicodeDecodeError:
            raise CollectorConfigError(f"the token file {token_file} is not text (UTF-8): "
                                       "write the token as a line of text") from None
        if not token:
            raise CollectorConfigError(f"the token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_VARIABLE) or None


class Collector:
    """Writes incoming records to per-run files; ``serve`` runs it until cancelled."""

    def __init__(self, out_dir: str | os.PathLike, *, token: str | None = None,
                 limits: CollectorLimits | None = None, insecure: bool = False,
                 tls: ssl.SSLContext | None = None) -> None:
        self.out_dir = os.fspath(out_dir)
        # A server context (tls_context()): clients then need SocketSink(tls_ca_file=...).
        self.tls = tls
        os.makedirs(self.out_dir, exist_ok=True)
        self.limits = limits or CollectorLimits()
        self.insecure = insecure
        self._token = token.encode() if token else None
        # Both keyed by the run file's path: run names that sanitise alike share one file, so
        # they must share its bookkeeping.
        self._runs: collections.OrderedDict[str, RunFile] = collections.OrderedDict()
        self._written: dict[str, dict[str, int]] = {}  # path -> sender -> next unwritten sequence
        self._writers: set[asyncio.StreamWriter] = set()
        # Connections that have not sent a valid header yet, oldest first: their peers and
        # handlers.
        self._unauthenticated: collections.OrderedDict[
            asyncio.StreamWriter, tuple[str, asyncio.Task | None]] = collections.OrderedDict()
        self._senders: dict[str, asyncio.StreamWriter] = {}  # sender -> its newest connection
        self._handlers: set[asyncio.Task] = set()
        self._closing = False  # serve() is ending: no handler may open a run file any more
        self._logged: set[tuple[str, str]] = set()
        self._disk_checked = 0.0
        self._disk_low = False
        self.records_written = 0
        self.bytes_written = 0
        self.duplicates_dropped = 0
        self.connections = 0
        self.clients = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self.port: int | None = None

    # ---- files ----

    def path_for(self, run: str) -> str:
        return os.path.join(self.out_dir, (_SAFE_RUN.sub("_", run) or "run") + ".hcbs")

    def _run_file(self, run: str) -> RunFile:
        path = self.path_for(run)
        run_file = self._runs.get(path)
        if run_file is not None:
            self._runs.move_to_end(path)
            return run_file
        if path not in self._written:
            senders: dict[str, int] = {}
            if os.path.exists(path):
                senders, intact_end, framed = scan_run_file(path)
                if framed and intact_end < os.path.getsize(path):
                    logger.warning("collector: %s ends in a torn frame (a crash mid-write); "
                                   "cutting it off at byte %d before appending", path, intact_end)
                    os.truncate(path, intact_end)
            self._written[path] = senders
        while len(self._runs) >= self.limits.max_open_runs:
            _, oldest = self._runs.popitem(last=False)
            oldest.file.close()
        run_file = RunFile(path)
        if run_file.file.tell() == 0:
            try:
                write_all(run_file.file, file_header(run))
            except OSError:
                run_file.file.truncate(0)
                run_file.file.close()
                raise
        self._runs[path] = run_file
        return run_file

    def _write(self, run: str, sender: str, source: str, first: int, data: bytes,
               count: int) -> None:
        """Appends ``count`` record frames (sequence numbers ``first``...) from one sender."""
        run_file = self._run_file(run)
        parts = []
        if run_file.segment != (sender, first):
            parts.append(segment_header(run, source, sender, first))
        parts.append(data)
        blob = b"".join(parts) if len(parts) > 1 else data
        before = run_file.file.tell()
        try:
            write_all(run_file.file, blob)
        except OSError as error:  # disk full, a quota, a size limit: leave no partial frame
            run_file.file.truncate(before)
            run_file.file.seek(before)  # else tell() stays past the end and misleads the next
            run_file.segment = None
            raise Refuse(Reason.WRITE_FAILED, path=run_file.path,
                         error=error.strerror or error) from error
        run_file.segment = (sender, first + count)
        self._written[run_file.path][sender] = first + count
        self.records_written += count
        self.bytes_written += len(blob)

    def close(self) -> None:
        for run_file in self._runs.values():
            run_file.file.close()
        self._runs.clear()

    def free_bytes(self) -> int:
        """Free space where the run files are (tests replace this)."""
        return shutil.disk_usage(self.out_dir).free

    async def _wait_for_disk(self, writer: asyncio.StreamWriter) -> None:
        """Stops taking records (the senders wait) while free space is below the limit."""
        while True:
            if writer.is_closing():  # replaced by its sender's newer connection, or shut down
                raise ConnectionResetError("the connection was closed while waiting for disk")
            now = time.monotonic()
            if now - self._disk_checked >= 1.0 or self._disk_low:
                self._disk_checked = now
                low = self.free_bytes() < self.limits.min_free_bytes
                if low and not self._disk_low:
                    logger.warning("collector: less than %d bytes free in %s; not taking records "
                                   "until there is room (senders wait)", self.limits.min_free_bytes,
                                   self.out_dir)
                elif self._disk_low and not low:
                    logger.warning("collector: disk space is back; taking records again")
                self._disk_low = low
            if not self._disk_low:
                return
            await asyncio.sleep(0.2)

    # ---- connections ----

    def _log_once(self, peer: str, kind: str, message: str) -> None:
        self.refused[kind] += 1
        host = peer.rsplit(":", 1)[0]
        if (host, kind) in self._logged:
            logger.debug("collector: dropping %s: %s", peer, message)
            return
        self._logged.add((host, kind))
        logger.warning("collector: dropping %s: %s (logged once per host; counted in refused)",
                       peer, message)

    def _frames(self, buffer: bytearray, limit: int, records: bool) -> tuple[int, int]:
        """How many complete, intact frames ``buffer`` starts with (records only, or just the
        header), and their bytes; raises for damage or a frame over ``limit``."""
        count, position, size = 0, 0, len(buffer)
        with memoryview(buffer) as view:
            while size - position >= FRAME.size:
                marker, length, crc = FRAME.unpack_from(buffer, position)
                if marker != SYNC:
                    raise Refuse(Reason.NOT_A_FRAME)
                if records and count and (length > limit or length == 0):
                    break  # take the records before it first (a heartbeat, or one too large)
                if length > limit:
                    raise Refuse(Reason.RECORD_TOO_LARGE if records else Reason.HEADER_TOO_LARGE,
                                 limit, size=length)
                end = position + FRAME.size + length
                if end > size:
                    break
                payload = view[position + FRAME.size:end]
                if zlib.crc32(payload) != crc:
                    raise Refuse(Reason.BAD_CRC)
                # Only records: a header among them could forge another sender or source.
                if records and not is_record(payload):
                    raise Refuse(Reason.NOT_A_RECORD)
                count += 1
                position = end
                if not records:
                    return count, position
            if size - position and not SYNC.startswith(bytes(view[position:position + 4])):
                raise Refuse(Reason.NOT_A_FRAME)
        return count, position

    def _admit(self, writer: asyncio.StreamWriter, peer: str, task: asyncio.Task | None) -> None:
        """Counts a new connection against the cap on unauthenticated ones at once, before any
        TLS handshake; when they are full, the oldest is dropped for it."""
        if len(self._unauthenticated) >= self.limits.max_clients:
            _, (oldest_peer, oldest_task) = self._unauthenticated.popitem(last=False)
            self._log_once(oldest_peer, "no header in time",
                           f"{self.limits.max_clients} connections wait for their header (the "
                           "limit): the oldest is dropped for a newer one")
            # Its handler is cancelled, not its transport aborted: aborted mid-handshake, the
            # transport makes StreamWriter.start_tls end in an AttributeError (3.11 to 3.13).
            if oldest_task is not None:
                oldest_task.cancel()
        self._unauthenticated[writer] = (peer, task)

    async def _start_tls(self, writer: asyncio.StreamWriter, peer: str) -> bool:
        """The TLS handshake of a connection accepted as plain TCP, within stall_seconds; False
        (logged) when it fails or takes longer. Not start_server(ssl=...): its handshake runs
        before the handler sees the connection, where neither the cap on unauthenticated
        connections nor their deadline could stop idle ones from using up the collector's files."""
        try:
            await writer.start_tls(self.tls, ssl_handshake_timeout=self.limits.stall_seconds)
        except OSError as error:  # ssl.SSLError, the peer gone, or the handshake's timeout
            self._log_once(peer, "tls handshake", f"no TLS handshake: {error}")
            return False
        return True

    def _record_seconds(self, buffer: bytearray) -> float:
        """How long the record that ``buffer`` starts with may take to arrive whole from its first
        byte: stall_seconds, plus a second per _RECORD_BYTES_PER_SECOND of its length (once its
        frame header tells it)."""
        length = FRAME.unpack_from(buffer)[1] if len(buffer) >= FRAME.size else 0
        return self.limits.stall_seconds + length / _RECORD_BYTES_PER_SECOND

    def _timed_out(self, header: dict[str, Any] | None, buffer: bytearray,
                   last_read: float) -> Refuse:
        """Why a connection whose read timed out is dropped; mid-record, it was either silent for
        stall_seconds or sent bytes, but not the whole record in time."""
        limits = self.limits
        if header is None:
            return Refuse(Reason.HEADER_STALLED, seconds=limits.stall_seconds)
        if not buffer:
            return Refuse(Reason.IDLE, seconds=limits.idle_seconds)
        if time.monotonic() - last_read >= limits.stall_seconds:
            return Refuse(Reason.RECORD_STALLED, seconds=limits.stall_seconds)
        return Refuse(Reason.RECORD_TOO_SLOW, seconds=f"{self._record_seconds(buffer):.3g}")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:  # accepted just before serve() ended, which dropped the others
            writer.transport.abort()
            return
        self.connections += 1
        peername = writer.get_extra_info("peername") or ("?", 0)
        peer = f"{peername[0]}:{peername[1]}"
        sock = writer.get_extra_info("socket")
        if sock is not None:  # the kernel notices a dead peer even while we only wait to read
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._admit(writer, peer, task)
        authenticated = False
        sender = None
        buffer = bytearray()
        header: dict[str, Any] | None = None
        header_deadline = time.monotonic() + self.limits.stall_seconds
        record_started = last_read = time.monotonic()  # record_started: of the record in buffer
        received = 0
        try:
            # Nothing above may wait: the client's first TLS bytes must reach the handshake, not
            # this connection's plain reader.
            if self.tls is not None and not await self._start_tls(writer, peer):
                return
            self._writers.add(writer)
            while True:
                if header is None:  # one deadline for the handshake and the whole header
                    wait = header_deadline - time.monotonic()
                elif buffer:  # mid-record: a deadline for each read, and one for the record
                    wait = min(self.limits.stall_seconds,
                               record_started + self._record_seconds(buffer) - time.monotonic())
                else:
                    wait = self.limits.idle_seconds
                try:
                    chunk = await asyncio.wait_for(reader.read(_READ_BYTES), max(0.0, wait))
                except TimeoutError:
                    raise self._timed_out(header, buffer, last_read) from None
                last_read = time.monotonic()
                if not chunk:
                    if header is None:
                        raise Refuse(Reason.NO_HEADER)
                    if received == 0:
                        self._log_once(peer, "no records", "closed without sending a record")
                    break  # a torn last record is sent again by its sender
                buffer += chunk
                arrived = len(buffer)
                if header is None:
                    found, used = self._frames(buffer, _HEADER_BYTES, records=False)
                    if not found:
                        continue
                    header = check_sender_header(bytes(buffer[FRAME.size:used]), self._token)
                    del buffer[:used]
                    del self._unauthenticated[writer]
                    if self.clients >= self.limits.max_clients and \
                            header["sender"] not in self._senders:  # a reconnect replaces one
                        raise Refuse(Reason.TOO_MANY_CLIENTS, self.limits.max_clients)
                    self.clients += 1
                    authenticated = True
                    run = str(header.get("run", "run"))
                    sender, next_sequence = header["sender"], header["first"]
                    source = (f"{header.get('host', '?')}:{header.get('pid', '?')}"
                              f"/p{header.get('process', 0)}")
                    logger.debug("collector: %s streams run %r as %s", peer, run, source)
                    older = self._senders.get(sender)
                    if older is not None:  # a reconnect: the old connection is dead or dying
                        logger.debug("collector: %s reconnected; closing its older connection",
                                     sender)
                        older.transport.abort()
                    self._senders[sender] = writer
                while True:
                    while buffer.startswith(HEARTBEAT):
                        del buffer[:len(HEARTBEAT)]
                    count, used = self._frames(buffer, self.limits.max_record_bytes, records=True)
                    if not count:
                        break
                    await self._wait_for_disk(writer)
                    self._take(buffer, count, used, run, sender, source, next_sequence)
                    next_sequence += count
                    received += count
                    del buffer[:used]
                    writer.write(ACK.pack(received))
                    try:  # a client that reads no acknowledgements must not hold a slot forever
                        await asyncio.wait_for(writer.drain(), self.limits.stall_seconds)
                    except TimeoutError:
                        raise Refuse(Reason.ACKNOWLEDGEMENTS_UNREAD,
                                     seconds=self.limits.stall_seconds) from None
                if len(buffer) < arrived or arrived == len(chunk):  # a new record began
                    record_started = time.monotonic()
        except Refuse as refuse:
            refusal = refuse.refusal
            self._log_once(peer, _KINDS[refusal.reason], refusal.text)
            try:
                writer.write(refusal.pack())
                await asyncio.wait_for(writer.drain(), 1.0)
            except (ConnectionError, TimeoutError):
                pass
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.clients -= authenticated
            self._unauthenticated.pop(writer, None)
            self._writers.discard(writer)
            if sender is not None and self._senders.get(sender) is writer:
                del self._senders[sender]
            if task is not None:
                self._handlers.discard(task)
            writer.close()

    def _take(self, buffer: bytearray, count: int, used: int, run: str, sender: str,
              source: str, first: int) -> None:
        """Writes the records of ``buffer[:used]`` (sequence numbers ``first``...) that this
        sender's run file does not hold yet."""
        if self._closing:  # a handler that waited (for disk) past shutdown
            raise Refuse(Reason.SHUTTING_DOWN)
        path = self.path_for(run)
        try:
            if path not in self._written:
                self._run_file(run)  # rebuilds what the run file holds
            skip = max(0, min(count, self._written[path].get(sender, 0) - first))
        except OSError as error:  # cannot open, scan or truncate the run file
            raise Refuse(Reason.WRITE_FAILED, path=path, error=error.strerror or error) from error
        start = 0
        for _ in range(skip):
            start += FRAME.size + FRAME.unpack_from(buffer, start)[1]
        self.duplicates_dropped += skip
        if count > skip:
            try:
                self._write(run, sender, source, first + skip, bytes(buffer[start:used]),
                            count - skip)
            except OSError as error:  # reopening an LRU-closed run file
                raise Refuse(Reason.WRITE_FAILED, path=path,
                             error=error.strerror or error) from error

    # ---- serving ----

    def check_bind(self, host: str) -> None:
        if not is_loopback(host) and self._token is None and not self.insecure:
            raise CollectorConfigError(
                f"refusing to listen on {host} without a token: anyone who reaches the port could "
                f"write into {self.out_dir}. Set {TOKEN_VARIABLE} (or --token-file) on the "
                "collector and its senders, or pass --insecure on a network you trust.")

    async def serve(self, host: str, port: int, ready: asyncio.Event | None = None) -> None:
        self.check_bind(host)
        # Plain TCP even with TLS: each handler runs its own handshake (_start_tls), so that
        # the limits on unauthenticated connections see them from the start.
        server = await asyncio.start_server(self.handle, host, port, limit=_READ_BYTES)
        self.port = server.sockets[0].getsockname()[1]
        logger.info("collector: listening on %s:%d, writing to %s", host, self.port, self.out_dir)
        if ready is not None:
            ready.set()
        try:
            # Not serve_forever() nor ``async with server``: from Python 3.12.1 both end by
            # awaiting Server.wait_closed(), which waits for every connection to end, and ours
            # end only when the shutdown below drops them, so serve() would never return.
            await asyncio.get_running_loop().create_future()
        finally:
            server.close()  # listen no more, so a restarted collector can take the port
            self._closing = True
            for writer in list(self._writers):  # drop the clients, so that their senders notice
                writer.transport.abort()
            # Connections still in their TLS handshake are not in _writers (an aborted one would
            # break StreamWriter.start_tls): cancelling their handlers closes them.
            handlers = [task for task in self._handlers if task is not asyncio.current_task()]
            for task in handlers:  # one waiting for disk would otherwise reopen a run file
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            self.close()
            try:  # lets the aborted connections finish closing; bounded all the same
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except TimeoutError:
                pass

    def counts(self) -> str:
        refused = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.refused.items())) or "none"
        return (f"{self.records_written} records ({self.bytes_written} bytes) written from "
                f"{self.connections} connections; {self.duplicates_dropped} duplicates dropped; "
                f"dropped clients: {refused}")


class CollectorThread:
    """A Collector serving from a background thread (tests, notebooks, a launcher process)."""

    def __init__(self, out_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0,
                 **options: Any) -> None:
        self.collector = Collector(out_dir, **options)
        self.host, self.port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 10.0) -> CollectorThread:
        started = threading.Event()

        async def run() -> None:
            ready = asyncio.Event()
            self._task = asyncio.ensure_future(self.collector.serve(self.host, self.port, ready))
            waiting = asyncio.ensure_future(ready.wait())
            await asyncio.wait([self._task, waiting], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            self.port = self.collector.port
            started.set()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception as error:  # noqa: BLE001 (reported by start())
                self._error = error

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(run())
            self._loop.close()

        self._thread = threading.Thread(target=main, daemon=True, name="hostcallback-collector")
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"collector did not start listening within {timeout} s")
        if self.collector.port is None:
            self._thread.join(timeout)
            raise self._error or RuntimeError("the collector stopped before it listened")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._task is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(10)
