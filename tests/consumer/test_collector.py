"""The collector on a shared network: token, limits, exactly once across reconnects and restarts,
bad clients, and the `collect` command.

Longer than the other test files on purpose: each test needs a live collector and senders
(the fixtures at the top), and splitting them would split those fixtures between files.
"""

import asyncio
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import free_port, wait_until
from hostcallback.consumer import SocketSink, TapRecord, protocol, read_records, socket_sink, stream
from hostcallback.consumer.collector import (
    Collector,
    CollectorConfigError,
    CollectorLimits,
    CollectorThread,
    tls_context,
)
from hostcallback.consumer.protocol import Reason, Refusal
from hostcallback.consumer.run_files import scan_run_file

pytestmark = pytest.mark.timeout(120)


def header(run="raw", sender="raw-sender", first=0, **extra) -> bytes:
    return stream.frame_item(stream.stream_header(run=run, sender=sender, first=first, process=0,
                                                  **extra))


def frames(values, name="r") -> bytes:
    return b"".join(stream.frame_item(TapRecord(name=name, value=v).to_map()) for v in values)


def read_acks(client: socket.socket, count: int) -> int:
    """Reads acknowledgements until ``count`` records are acknowledged; returns the last total."""
    data, total = b"", 0
    client.settimeout(20)
    while total < count:
        data += client.recv(4096)
        while len(data) >= protocol.ACK.size:
            (total,) = protocol.ACK.unpack_from(data)
            data = data[protocol.ACK.size:]
    return total


def refused(client: socket.socket) -> Refusal:
    """The refusal the collector sends before it hangs up on a client."""
    client.settimeout(20)
    data = b""
    while True:
        chunk = client.recv(4096)
        if not chunk:
            break
        data += chunk
    while len(data) >= protocol.ACK.size and \
            protocol.ACK.unpack_from(data)[0] != protocol.REFUSED:
        data = data[protocol.ACK.size:]
    assert len(data) >= protocol.ACK.size, "the collector hung up without saying why"
    assert len(data) == Refusal.size_of(data), "a refusal is followed by nothing"
    return Refusal.unpack(data)


def refusal(client: socket.socket) -> str:
    """The text of the collector's refusal, for people."""
    return refused(client).text


def closed_by_peer(client: socket.socket) -> bool:
    """Whether the collector has closed this connection (without reading what it holds)."""
    if not select.select([client], [], [], 0)[0]:
        return False
    try:
        return client.recv(1, socket.MSG_PEEK) == b""
    except ConnectionError:
        return True


def trickle(client: socket.socket, data: bytes, seconds: float, budget: float = 10.0) -> None:
    """Sends ``data`` a byte every ``seconds`` until the collector answers (a refusal), failing
    after ``budget`` s."""
    deadline = time.monotonic() + budget
    for byte in data:
        if select.select([client], [], [], seconds)[0]:
            return
        assert time.monotonic() < deadline, f"still connected after {budget} s"
        try:
            client.sendall(bytes([byte]))
        except BrokenPipeError:
            return
    raise AssertionError("the whole record went out: it is too short for this test")


def values_in(path, name="r"):
    return [int(r.value) for r in read_records(path) if r.name == name]


@pytest.fixture
def make_collector(tmp_path):
    servers = []

    def make(**options):
        server = CollectorThread(tmp_path / "out", **options).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


# ---- authentication ----


def test_a_collector_with_a_token_refuses_a_sender_without_it(make_collector, monkeypatch, caplog):
    monkeypatch.delenv(protocol.TOKEN_VARIABLE, raising=False)
    server = make_collector(token="s3cret-token")
    sink = SocketSink("127.0.0.1", server.port, run="auth", flush_timeout=10)
    sink.emit(TapRecord(name="r", value=1))
    with pytest.raises(TimeoutError, match="wrong or missing token"):
        sink.flush(timeout=1.0)
    sink.close(timeout=0.1)
    assert server.collector.refused["token"] >= 1
    assert server.collector.records_written == 0
    assert "s3cret-token" not in caplog.text


def test_a_sender_with_the_collectors_token_is_accepted(make_collector, monkeypatch):
    monkeypatch.setenv(protocol.TOKEN_VARIABLE, "s3cret-token")
    server = make_collector(token="s3cret-token")
    sink = SocketSink("127.0.0.1", server.port, run="auth")  # reads the token from the variable
    for i in range(5):
        sink.emit(TapRecord(name="r", value=i))
    assert sink.close() == 0
    assert values_in(server.collector.path_for("auth")) == list(range(5))


def test_the_token_is_not_written_to_the_run_file(make_collector):
    server = make_collector(token="s3cret-token")
    sink = SocketSink("127.0.0.1", server.port, run="auth", token="s3cret-token")
    sink.emit(TapRecord(name="r", value=1))
    sink.close()
    with open(server.collector.path_for("auth"), "rb") as file:
        assert b"s3cret-token" not in file.read()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_without_a_token_the_collector_refuses_to_listen_beyond_loopback(tmp_path, host):
    with pytest.raises(CollectorConfigError, match=f"refusing to listen on {host} without a token"):
        CollectorThread(tmp_path, host=host).start()


def test_insecure_or_a_token_allows_listening_beyond_loopback(tmp_path):
    for options in ({"insecure": True}, {"token": "t"}):
        server = CollectorThread(tmp_path, host="0.0.0.0", **options).start()
        assert server.port
        server.stop()


# ---- limits ----


def test_a_record_over_the_size_limit_is_refused_and_the_earlier_ones_kept(make_collector):
    server = make_collector(limits=CollectorLimits(max_record_bytes=1000))
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(header() + frames([1, 2]))
        assert read_acks(client, 2) == 2
        client.sendall(stream.frame(b"\x8c\xa4name" + bytes(2000)))
        answer = refused(client)
    # The code and the limit are what a sender acts on; the text is for people (and older
    # senders), the same sentence as before the codes.
    assert (answer.reason, answer.limit) == (Reason.RECORD_TOO_LARGE, 1000)
    assert answer.text == "a record of 2006 bytes is over the collector's limit of 1000 bytes"
    assert values_in(server.collector.path_for("raw")) == [1, 2]
    assert server.collector.refused["too large"] == 1


def test_a_sink_refuses_a_record_over_its_max_record_bytes_at_emit(make_collector):
    server = make_collector()
    sink = SocketSink("127.0.0.1", server.port, max_record_bytes=1000)
    with pytest.raises(ValueError, match="over this SocketSink's max_record_bytes=1000"):
        sink.emit(TapRecord(name="big", value=np.zeros(1000)))
    sink.close()


def test_clients_over_the_limit_are_refused(make_collector):
    server = make_collector(limits=CollectorLimits(max_clients=2))
    first, second = (socket.create_connection(("127.0.0.1", server.port)) for _ in range(2))
    try:
        for index, client in enumerate((first, second)):
            client.sendall(header(sender=f"sender-{index}") + frames([1]))
            read_acks(client, 1)
        with socket.create_connection(("127.0.0.1", server.port)) as third:
            third.sendall(header(sender="sender-2"))  # counted once it has sent its header
            answer = refused(third)
            assert (answer.reason, answer.limit) == (Reason.TOO_MANY_CLIENTS, 2)
            assert "already serves 2 clients" in answer.text
    finally:
        first.close()
        second.close()


def test_a_client_that_trickles_its_header_is_dropped_after_stall_seconds(make_collector):
    server = make_collector(token="secret", limits=CollectorLimits(stall_seconds=0.5))
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(stream.FRAME.pack(stream.SYNC, 60000, 0))  # a long header, never finished
        deadline = time.monotonic() + 10
        try:
            while not select.select([slow], [], [], 0.1)[0]:  # one byte per 0.1 s < 0.5 s
                assert time.monotonic() < deadline, "still connected after 10 s"
                slow.sendall(b"x")
        except BrokenPipeError:
            pass
        assert "no whole stream header within 0.5 s" in refusal(slow)
    assert server.collector.refused["stalled"] == 1


def test_a_client_that_trickles_a_record_is_dropped_while_a_sender_is_served(make_collector):
    server = make_collector(limits=CollectorLimits(stall_seconds=0.5))
    sink = SocketSink("127.0.0.1", server.port, run="good")
    record = frames([np.zeros(1000)])  # 8 KB: it may take 0.5 s, plus 8 KB at 64 KiB/s
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(header() + record[:stream.FRAME.size])
        for value in range(3):
            sink.emit(TapRecord(name="r", value=value))
        trickle(slow, record[stream.FRAME.size:], 0.1)  # a byte per 0.1 s, each within 0.5 s
        answer = refused(slow)
    assert time.monotonic() - started < 5  # before the fix: connected as long as it trickles
    assert answer.reason is Reason.RECORD_TOO_SLOW
    assert answer.text.startswith("no whole record within 0.6")
    sink.flush(timeout=10)
    assert values_in(server.collector.path_for("good")) == [0, 1, 2]
    assert server.collector.refused["stalled"] == 1
    assert sink.close() == 0


class _DeafWriter:
    """A StreamWriter whose peer reads nothing: drain() never returns."""

    def __init__(self):
        self.written = bytearray()
        self.transport = self

    def write(self, data):
        self.written += data

    async def drain(self):
        await asyncio.Event().wait()

    def get_extra_info(self, name, default=None):
        return default

    def is_closing(self):
        return False

    def close(self):
        pass

    def abort(self):
        pass


@pytest.mark.timeout(30)
def test_a_client_that_reads_no_acknowledgements_is_dropped_after_stall_seconds(tmp_path):
    async def scenario():
        collector = Collector(tmp_path / "out", limits=CollectorLimits(stall_seconds=0.3,
                                                                     min_free_bytes=0))
        reader = asyncio.StreamReader()
        reader.feed_data(header() + frames([1, 2]))
        await asyncio.wait_for(collector.handle(reader, _DeafWriter()), 10)  # before: forever
        collector.close()
        return collector

    collector = asyncio.run(scenario())
    assert collector.refused["stalled"] == 1 and collector.records_written == 2


def test_clients_without_a_header_do_not_lock_out_a_sender_with_the_token(make_collector):
    server = make_collector(token="secret", limits=CollectorLimits(max_clients=1))
    with socket.create_connection(("127.0.0.1", server.port)) as silent:
        wait_until(lambda: server.collector.connections == 1, what="the connection")
        with socket.create_connection(("127.0.0.1", server.port)) as sender:
            sender.sendall(header(token="secret") + frames([1]))
            assert read_acks(sender, 1) == 1
        silent.settimeout(20)
        assert silent.recv(4096) == b""  # the oldest connection without a header made room
    assert server.collector.refused["no header in time"] == 1


def test_open_run_files_are_bounded_and_every_record_kept(make_collector):
    server = make_collector(limits=CollectorLimits(max_open_runs=2))
    for round_ in range(2):
        for run in ("a", "b", "c"):
            with socket.create_connection(("127.0.0.1", server.port)) as client:
                client.sendall(header(run=run, sender=f"{run}-{round_}") + frames([round_]))
                read_acks(client, 1)
            assert len(server.collector._runs) <= 2
    for run in ("a", "b", "c"):
        assert values_in(server.collector.path_for(run)) == [0, 1]


def test_low_disk_stops_writing_until_there_is_room(make_collector):
    server = make_collector()
    server.collector.free_bytes = lambda: 0
    sink = SocketSink("127.0.0.1", server.port, run="disk")
    for i in range(3):
        sink.emit(TapRecord(name="r", value=i))
    with pytest.raises(TimeoutError, match="3 records not acknowledged"):
        sink.flush(timeout=1.0)
    assert server.collector.records_written == 0
    server.collector.free_bytes = lambda: 1 << 40
    sink.flush(timeout=20)
    assert values_in(server.collector.path_for("disk")) == [0, 1, 2]
    sink.close()


def test_a_sender_says_a_collector_short_of_disk_takes_nothing_not_that_it_is_unreachable(
        make_collector, monkeypatch):
    monkeypatch.setattr(socket_sink, "_SEND_TIMEOUT", 1.0)
    server = make_collector()
    server.collector.free_bytes = lambda: 0  # it stops reading: the sender's sends stall
    sink = SocketSink("127.0.0.1", server.port, run="disk")
    for _ in range(24):  # 24 MiB: more than the sockets' buffers hold
        sink.emit(TapRecord(name="big", value=np.zeros(1 << 18, np.float32)))
    wait_until(lambda: sink.problem is not None, what="the sender to give up on a send")
    assert "the collector took no bytes for 1 s, though connected" in sink.problem
    assert "cannot reach" not in sink.problem
    server.collector.free_bytes = lambda: 1 << 40
    sink.flush(timeout=60)
    sink.close()


# Runs ``python -m hostcallback.consumer collect ...`` with a file size limit; a write past it is
# then short (it returns fewer bytes) or fails with EFBIG, and no SIGXFSZ kills the process.
_COLLECT_WITH_SIZE_LIMIT = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
runpy.run_module("hostcallback.consumer", run_name="__main__")
"""


def test_a_short_write_is_cut_off_and_never_acknowledged(tmp_path):
    # RLIMIT_FSIZE makes the write that crosses it short (it returns fewer bytes, raising
    # nothing), as a full disk or a quota can: that record must not be acknowledged.
    out = tmp_path / "out"
    server = subprocess.Popen(
        [sys.executable, "-c", _COLLECT_WITH_SIZE_LIMIT, "100000", "collect", "--port", "0",
         "--out", str(out), "--min-free-bytes", "0"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline().split()[3].rsplit(":", 1)[1].rstrip(","))
        acknowledged, reason = 0, ""
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.settimeout(20)
            client.sendall(header(run="full"))
            for i in range(30):  # about 10 KB each: the limit falls inside one of them
                client.sendall(frames([np.full(2500, i, np.float32)]))
                data = b""
                while len(data) < protocol.ACK.size:
                    data += client.recv(protocol.ACK.size - len(data))
                (total,) = protocol.ACK.unpack(data)
                if total == protocol.REFUSED:
                    (length,) = protocol.REASON.unpack(client.recv(protocol.REASON.size))
                    reason = client.recv(length).decode()
                    break
                acknowledged = total
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=20)
    assert "File too large" in reason
    skipped = []
    values = [int(r.value[0]) for r in read_records(out / "full.hcbs", skipped)]
    assert 0 < acknowledged < 30
    assert values == list(range(acknowledged))  # every acknowledged record, whole; no other
    assert skipped == []


def test_a_record_over_the_collectors_limit_is_dropped_once_and_later_ones_delivered(
        make_collector, caplog):
    server = make_collector(limits=CollectorLimits(max_record_bytes=1000))
    sink = SocketSink("127.0.0.1", server.port, run="big")  # its own limit is 4 MiB
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink.emit(TapRecord(name="r", value=0))
        sink.emit(TapRecord(name="r", value=np.zeros(1000)))
        for value in (2, 3):
            sink.emit(TapRecord(name="r", value=value))
        sink.flush(timeout=20)
    assert values_in(server.collector.path_for("big")) == [0, 2, 3]
    assert sink.dropped == 1
    assert sum("dropped record 'r'" in r.getMessage() for r in caplog.records) == 1
    assert sink.max_record_bytes == 1000  # the collector's limit, learnt from its refusal
    assert sink.close() == 0


def test_the_collector_takes_the_records_before_one_over_its_limit(make_collector):
    server = make_collector(limits=CollectorLimits(max_record_bytes=1000))
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(header() + frames([1, 2]) + stream.frame(b"\x8c\xa4name" + bytes(2000)))
        client.settimeout(20)
        data = b""
        while chunk := client.recv(4096):
            data += chunk
    # First the acknowledgement of both records, then the refusal of the third.
    assert protocol.ACK.unpack_from(data)[0] == 2
    assert protocol.ACK.unpack_from(data, protocol.ACK.size)[0] == protocol.REFUSED
    assert b"over the collector's limit of 1000" in data
    assert values_in(server.collector.path_for("raw")) == [1, 2]


def test_a_client_idle_between_records_past_idle_seconds_is_dropped(make_collector):
    server = make_collector(limits=CollectorLimits(idle_seconds=0.3))
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(header() + frames([1]))
        read_acks(client, 1)
        assert "no record or heartbeat for 0.3 s" in refusal(client)
    assert server.collector.refused["idle"] == 1


def test_a_sinks_heartbeats_keep_an_idle_connection_open(make_collector):
    server = make_collector(limits=CollectorLimits(idle_seconds=2.0))
    sink = SocketSink("127.0.0.1", server.port, run="beat", heartbeat_seconds=0.1)
    sink.emit(TapRecord(name="r", value=1))
    sink.flush(timeout=20)
    time.sleep(3.0)  # longer than idle_seconds without a record
    sink.emit(TapRecord(name="r", value=2))
    sink.flush(timeout=20)
    assert sink.reconnects == 0 and server.collector.refused["idle"] == 0
    assert server.collector.connections == 1
    assert sink.close() == 0


def test_a_reconnect_of_the_same_sender_closes_its_older_connection(make_collector):
    server = make_collector()
    older = socket.create_connection(("127.0.0.1", server.port))
    try:
        older.sendall(header(sender="same") + frames([1]))
        read_acks(older, 1)
        with socket.create_connection(("127.0.0.1", server.port)) as newer:
            newer.sendall(header(sender="same", first=1) + frames([2]))
            read_acks(newer, 1)
            older.settimeout(20)
            assert older.recv(4096) == b""  # the collector closed it
            wait_until(lambda: server.collector.clients == 1, what="one client left")
    finally:
        older.close()
    assert values_in(server.collector.path_for("raw")) == [1, 2]


def test_a_run_file_that_cannot_be_opened_is_a_refusal_with_a_reason(make_collector):
    server = make_collector()
    os.makedirs(server.collector.path_for("blocked"))  # a directory where the file should be
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(header(run="blocked") + frames([1]))
        assert "cannot write" in refusal(client)
    assert server.collector.refused["write failed"] == 1


def test_run_names_that_sanitise_to_one_file_share_its_bookkeeping(make_collector):
    server = make_collector()
    for run, sender, first, values in (("exp/1", "a", 0, [0, 1]), ("exp_1", "b", 0, [10, 11]),
                                       ("exp/1", "a", 2, [2, 3])):
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(header(run=run, sender=sender, first=first) + frames(values))
            read_acks(client, len(values))
    path = server.collector.path_for("exp/1")
    assert path == server.collector.path_for("exp_1")
    assert scan_run_file(path)[0] == {"a": 4, "b": 2}  # which sender wrote which records


@pytest.mark.timeout(30)
def test_a_handler_waiting_for_disk_does_not_reopen_a_run_file_after_shutdown(tmp_path):
    async def scenario():
        collector = Collector(tmp_path / "out")
        collector.free_bytes = lambda: 0
        ready = asyncio.Event()
        serving = asyncio.ensure_future(collector.serve("127.0.0.1", 0, ready))
        await ready.wait()
        _reader, writer = await asyncio.open_connection("127.0.0.1", collector.port)
        writer.write(header(run="late") + frames([1]))
        await writer.drain()
        while collector.clients == 0 or not collector._disk_low:
            await asyncio.sleep(0.02)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        collector.free_bytes = lambda: 1 << 40
        await asyncio.sleep(1.0)  # the waiting handler's next looks at the disk
        writer.close()
        return collector

    collector = asyncio.run(scenario())
    assert collector._runs == {} and collector.records_written == 0


# ---- exactly once ----


def test_records_sent_again_after_a_reconnect_are_written_once(make_collector):
    server = make_collector()
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(header(first=0) + frames(range(5)))
        read_acks(client, 5)
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(header(first=2) + frames(range(2, 8)))
        read_acks(client, 6)
    assert values_in(server.collector.path_for("raw")) == list(range(8))
    assert server.collector.duplicates_dropped == 3


def test_a_restarted_collector_drops_what_it_wrote_before(tmp_path):
    first = CollectorThread(tmp_path / "out").start()
    with socket.create_connection(("127.0.0.1", first.port)) as client:
        client.sendall(header(first=0) + frames(range(5)))
        read_acks(client, 5)
    first.stop()
    second = CollectorThread(tmp_path / "out").start()
    try:
        with socket.create_connection(("127.0.0.1", second.port)) as client:
            client.sendall(header(first=3) + frames(range(3, 7)))
            read_acks(client, 4)
        assert second.collector.duplicates_dropped == 2
    finally:
        second.stop()
    assert values_in(second.collector.path_for("raw")) == list(range(7))


def test_a_torn_frame_left_by_a_crash_is_cut_off_before_appending(tmp_path):
    first = CollectorThread(tmp_path / "out").start()
    with socket.create_connection(("127.0.0.1", first.port)) as client:
        client.sendall(header(first=0) + frames(range(3)))
        read_acks(client, 3)
    first.stop()
    path = first.collector.path_for("raw")
    with open(path, "ab") as file:
        file.write(frames([99])[:-5])  # the collector died mid-write
    second = CollectorThread(tmp_path / "out").start()
    try:
        with socket.create_connection(("127.0.0.1", second.port)) as client:
            client.sendall(header(first=3) + frames(range(3, 5)))
            read_acks(client, 2)
    finally:
        second.stop()
    skipped = []
    assert [int(r.value) for r in read_records(path, skipped)] == list(range(5))
    assert skipped == []


def test_a_sink_across_a_collector_restart_delivers_every_record_once(tmp_path):
    port = free_port()
    first = CollectorThread(tmp_path / "out", port=port).start()
    sink = SocketSink("127.0.0.1", port, run="restart")
    # The first collector's acknowledgements are lost (it dies before they arrive), so the sink
    # sends all its records again: the second must find them in the run file and drop them.
    sink._take_arrived = lambda connection, acks, on_connection: acks.clear()
    for i in range(50):
        sink.emit(TapRecord(name="r", value=i))
    wait_until(lambda: first.collector.records_written == 50, what="the first records")
    first.stop()
    wait_until(lambda: sink.reconnects >= 1, what="the sink to see the connection end")
    del sink._take_arrived
    for i in range(50, 100):
        sink.emit(TapRecord(name="r", value=i))
    second = CollectorThread(tmp_path / "out", port=port).start()
    try:
        assert sink.close(timeout=30) == 0
    finally:
        second.stop()
    assert values_in(second.collector.path_for("restart")) == list(range(100))
    assert second.collector.duplicates_dropped == 50
    assert second.collector.records_written == 50


# ---- bad clients ----


def _garbage(port):
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(os.urandom(64) + b"not a stream")
        refusal(client)


def _header_only(port):
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(header())


def _stall_mid_record(port):
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(header() + frames([1])[:-3])
        refusal(client)  # after stall_seconds


def _connect_and_leave(port):
    socket.create_connection(("127.0.0.1", port)).close()


@pytest.mark.parametrize("bad_client, kind, message", [
    (_garbage, "garbage", "not a stream frame"),
    (_header_only, "no records", "closed without sending a record"),
    (_stall_mid_record, "stalled", "in the middle of a record"),
    (_connect_and_leave, "no header", "closed before sending a stream header"),
], ids=["garbage", "header-without-records", "stall-mid-record", "reconnect-loop"])
def test_a_bad_client_is_logged_once_and_dropped_and_others_are_unaffected(
        make_collector, caplog, bad_client, kind, message):
    server = make_collector(limits=CollectorLimits(stall_seconds=0.3))
    sink = SocketSink("127.0.0.1", server.port, run="good")
    with caplog.at_level(logging.WARNING, logger="hostcallback.collector"):
        for round_ in range(4):
            sink.emit(TapRecord(name="r", value=round_))
            bad_client(server.port)
        wait_until(lambda: server.collector.refused[kind] >= 4, what=f"4 {kind} refusals")
        assert sink.close() == 0
    assert sum(message in r.getMessage() for r in caplog.records) == 1
    assert values_in(server.collector.path_for("good")) == [0, 1, 2, 3]


# ---- the collect command ----


def test_collect_prints_its_address_for_port_0_and_its_counts_when_stopped(tmp_path):
    server = subprocess.Popen([sys.executable, "-m", "hostcallback.consumer", "collect", "--port",
                               "0", "--out", str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        first_line = server.stdout.readline()
        assert first_line.startswith("collector listening on 127.0.0.1:")
        port = int(first_line.split(":")[1].split(",")[0])
        sink = SocketSink("127.0.0.1", port, run="cli")
        sink.emit(TapRecord(name="r", value=7))
        assert sink.close() == 0
    finally:
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=30)
    assert server.returncode == 0, err
    assert "collector stopped: 1 records" in out
    assert values_in(tmp_path / "cli.hcbs") == [7]


def test_collect_on_a_port_in_use_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run([sys.executable, "-m", "hostcallback.consumer", "collect", "--port",
                                 str(taken.getsockname()[1]), "--out", str(tmp_path)],
                                capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "address already in use" in result.stderr and "--port 0" in result.stderr


@pytest.mark.parametrize("option", [
    ["--max-open-runs", "0"], ["--max-clients", "0"], ["--max-record-bytes", "-1"],
    ["--min-free-bytes", "-1"], ["--stall-seconds", "-1"], ["--idle-seconds", "nan"],
    ["--port", "99999"], ["--port", "-1"], ["--token-file", "binary.token"],
    ["--tls-cert", "missing.pem", "--tls-key", "missing.key"]])
def test_collect_refuses_a_setting_that_cannot_work_in_one_line(tmp_path, option):
    """Before, a collector started with such a limit crashed on every connection (every
    record lost), and a bad port or token file ended in a traceback."""
    (tmp_path / "binary.token").write_bytes(bytes(range(128, 256)))
    result = subprocess.run([sys.executable, "-m", "hostcallback.consumer", "collect",
                             "--port", "0", "--out", str(tmp_path / "out"), *option],
                            capture_output=True, text=True, timeout=60, check=False,
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    said = result.stderr.strip().splitlines()[-1]  # after argparse's usage, where it prints one
    assert option[0] in said or "token file" in said or "no such TLS file" in said, said


def test_collect_without_a_token_beyond_loopback_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv(protocol.TOKEN_VARIABLE, raising=False)
    result = subprocess.run([sys.executable, "-m", "hostcallback.consumer", "collect", "--host",
                             "0.0.0.0", "--port", "0", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "without a token" in result.stderr and "--insecure" in result.stderr


# ---- TLS ----


def self_signed(directory, name):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_a_sink_streams_over_tls_to_a_collector_with_a_certificate(make_collector, tmp_path):
    cert, key = self_signed(tmp_path, "collector")
    server = make_collector(tls=tls_context(str(cert), str(key)), token="t")
    sink = SocketSink("127.0.0.1", server.port, run="tls", token="t", tls_ca_file=cert)
    for i in range(5):
        sink.emit(TapRecord(name="r", value=i))
    assert sink.close() == 0
    assert values_in(server.collector.path_for("tls")) == list(range(5))


def test_with_tls_idle_connections_over_the_cap_are_dropped_at_once_and_a_sender_delivers(
        make_collector, tmp_path):
    cert, key = self_signed(tmp_path, "collector")
    limits = CollectorLimits(max_clients=4)  # stall_seconds stays 60 s: only the cap drops them
    server = make_collector(tls=tls_context(str(cert), str(key)), token="t", limits=limits)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    try:  # none of them starts a TLS handshake
        # The cap holds the 4 newest. Before the fix none was closed: the handshake ran before
        # the handler, so the cap never saw them, and they held their files for 60 s.
        wait_until(lambda: sum(map(closed_by_peer, idle)) == 16, timeout=5,
                   what="all but the 4 newest idle connections closed")
        sink = SocketSink("127.0.0.1", server.port, run="tls", token="t", tls_ca_file=cert)
        for i in range(5):
            sink.emit(TapRecord(name="r", value=i))
        sink.flush(timeout=10)
        assert sum(map(closed_by_peer, idle)) == 17  # the sink's connection took one's place
        assert sink.close() == 0
    finally:
        for client in idle:
            client.close()
    assert values_in(server.collector.path_for("tls")) == list(range(5))
    assert server.collector.refused["no header in time"] == 17


def test_with_tls_a_connection_that_never_starts_its_handshake_is_dropped_after_stall_seconds(
        make_collector, tmp_path):
    cert, key = self_signed(tmp_path, "collector")
    server = make_collector(tls=tls_context(str(cert), str(key)),
                            limits=CollectorLimits(stall_seconds=0.5))
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        started = time.monotonic()
        wait_until(lambda: closed_by_peer(idle), timeout=5,  # before the fix: asyncio's 60 s
                   what="the collector to close a connection without a handshake")
    assert time.monotonic() - started >= 0.4
    wait_until(lambda: server.collector.refused["tls handshake"] == 1, what="it to be counted")


def test_a_sink_refuses_a_collector_whose_certificate_it_does_not_trust(make_collector, tmp_path):
    cert, key = self_signed(tmp_path, "collector")
    other, _ = self_signed(tmp_path, "other")
    server = make_collector(tls=tls_context(str(cert), str(key)))
    sink = SocketSink("127.0.0.1", server.port, run="tls", tls_ca_file=other)
    sink.emit(TapRecord(name="r", value=1))
    with pytest.raises(TimeoutError, match="CERTIFICATE_VERIFY_FAILED"):
        sink.flush(timeout=2)
    sink.close(timeout=0)
    assert server.collector.records_written == 0


def test_a_wrong_token_is_reported_as_such_and_never_as_an_unreachable_collector(
        make_collector, caplog):
    server = make_collector(token="right-token")
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink = SocketSink("127.0.0.1", server.port, run="auth", token="wrong-token")
        for i in range(3):
            sink.emit(TapRecord(name="r", value=i))
        wait_until(lambda: server.collector.refused.get("token", 0) >= 2, timeout=30)
        sink.close(timeout=0.1)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "hostcallback.sinks"]
    assert not any("cannot reach the collector" in message for message in warnings)
    assert sum("wrong or missing token" in message for message in warnings) == 1
