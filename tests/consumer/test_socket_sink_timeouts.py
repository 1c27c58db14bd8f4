"""SocketSink never waits longer than we allow: a barrier's timeout, close(), the exit deadline;
a collector that cannot be reached is reported once, and records that never arrive are named."""

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

import hostcallback as hcb
from helpers import free_port, run_python, wait_until
from hostcallback.consumer import SocketSink, TapRecord, tap_to
from hostcallback.consumer.protocol import (
    ACK,
    MAX_REFUSAL_TEXT,
    REASON,
    REFUSAL_CODE,
    REFUSED,
    Reason,
    Refusal,
)


@pytest.mark.timeout(20)  # before the fix this barrier waited the sink's 30 s
def test_barrier_wait_with_a_timeout_is_not_held_up_by_an_unreachable_collector(caplog):
    sink = SocketSink("127.0.0.1", free_port(), run="nobody", flush_timeout=60)
    jax.jit(lambda x: tap_to([sink], x, name="x"))(1.0)
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        hcb.barrier_wait(timeout=1.0)
    assert sink.pending == 1  # kept, not dropped
    assert "1 records not acknowledged yet" in caplog.text
    assert sink.close(timeout=0.1) == 1


@pytest.mark.timeout(20)
def test_close_is_bounded_and_names_the_records_it_could_not_deliver(caplog):
    sink = SocketSink("127.0.0.1", free_port(), run="nobody", flush_timeout=60)
    for i in range(3):
        sink.emit(TapRecord(name="r", value=i))
    with caplog.at_level(logging.ERROR, logger="hostcallback.sinks"):
        lost = sink.close(timeout=0.5)
    assert lost == 3
    assert "closed with 3 records the collector never acknowledged; they are lost" in caplog.text
    assert not sink._thread.is_alive()


@pytest.mark.timeout(20)
def test_flush_raises_after_its_timeout_naming_why(caplog):
    sink = SocketSink("127.0.0.1", free_port(), run="nobody")
    sink.emit(TapRecord(name="r", value=1))
    with pytest.raises(TimeoutError,
                       match=r"1 records not acknowledged after 0.5 s \(cannot reach"):
        sink.flush(timeout=0.5)
    sink.close(timeout=0)


@pytest.mark.timeout(30)
def test_an_unreachable_collector_is_reported_once(caplog):
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink = SocketSink("127.0.0.1", free_port(), run="nobody")
        sink.emit(TapRecord(name="r", value=1))
        deadline = time.monotonic() + 20
        while sink.connect_failures < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        sink.close(timeout=0)
    assert sink.connect_failures >= 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("cannot reach the collector" in message for message in warnings) == 1


@pytest.mark.timeout(60)  # before the fix, exit waited 60 s more than HOSTCALLBACK_EXIT_TIMEOUT
def test_exit_is_bounded_by_the_exit_timeout_with_an_unreachable_collector():
    port = free_port()
    result = run_python(f"""
        import jax
        from hostcallback.consumer import SocketSink, tap_to
        sink = SocketSink("127.0.0.1", {port}, run="nobody")
        jax.jit(lambda x: tap_to([sink], x, name="x"))(1.0)
        print("dispatched", flush=True)
        """, devices=1, env={"HOSTCALLBACK_EXIT_TIMEOUT": "2"}, timeout=45)
    assert result.returncode == 0, result.stderr
    assert "dispatched" in result.stdout
    assert "1 records the collector did not acknowledge are lost as this process exits" in \
        result.stderr
    assert "unless this process exits first" not in result.stderr


@pytest.mark.timeout(60)
def test_exit_says_what_a_socket_sink_waits_for_then_what_it_loses():
    port = free_port()
    started = time.monotonic()
    result = run_python(f"""
        import jax
        from hostcallback.consumer import SocketSink, tap_to
        sink = SocketSink("127.0.0.1", {port}, run="nobody")
        jax.jit(lambda x: tap_to([sink], x, name="x"))(1.0)
        """, devices=1, env={"HOSTCALLBACK_EXIT_TIMEOUT": "6"}, timeout=45)
    assert result.returncode == 0, result.stderr
    waits = re.search(r"exit waits up to ([0-9]+) s for the collector to acknowledge 1 records "
                      r"\(cannot reach", result.stderr)
    assert waits and 1 <= int(waits.group(1)) <= 3, result.stderr
    assert "1 records the collector did not acknowledge are lost as this process exits" in \
        result.stderr
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_exit_waits_for_the_collector_says_what_is_lost():
    port = free_port()
    code = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive run has it
        import jax
        from hostcallback.consumer import SocketSink, tap_to
        sink = SocketSink("127.0.0.1", {port}, run="nobody")
        jax.jit(lambda x: tap_to([sink], x, name="x"))(1.0)
        """)
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = []
    for line in child.stderr:
        lines.append(line)
        if "exit waits up to" in line:
            child.send_signal(signal.SIGINT)
            break
    rest = child.stderr.read()
    assert child.wait(timeout=30) == 0, "".join(lines) + rest
    assert "1 records the collector did not acknowledge are lost as this process exits" in rest
    assert "Traceback" not in rest, rest


class FakeCollector:
    """A listening socket whose connections ``serve(connection, index)`` handles, one by one."""

    def __init__(self, serve):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.connections = 0
        self._serve = serve
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(connection, self.connections),
                             daemon=True).start()

    def close(self):
        self.server.close()


def _read_forever(connection, index):
    with connection:
        while connection.recv(1 << 16):
            pass


@pytest.mark.timeout(30)
def test_a_collector_that_never_acknowledges_is_left_after_the_ack_timeout(caplog):
    silent = FakeCollector(_read_forever)
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink = SocketSink("127.0.0.1", silent.port, run="silent", ack_timeout=0.5)
        sink.emit(TapRecord(name="r", value=1))
        wait_until(lambda: silent.connections >= 2)  # it reconnected to send again
        sink.close(timeout=0)
    silent.close()
    assert sink.reconnects >= 1
    assert "acknowledged nothing for 0.5 s" in caplog.text


@pytest.mark.timeout(30)
def test_emit_on_a_full_buffer_drops_after_flush_timeout_and_says_so(caplog):
    sink = SocketSink("127.0.0.1", free_port(), run="full", max_buffered_bytes=100,
                      flush_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink.emit(TapRecord(name="r", value=1))
        sink.emit(TapRecord(name="r", value=2))  # waits for room, then gives up on this one
    assert sink.dropped == 1 and sink.pending == 1 and sink.waits == 1
    assert "dropped record 'r'" in caplog.text and "1 dropped so far" in caplog.text
    sink.close(timeout=0)


def _answer(connection, data: bytes) -> None:
    """Sends ``data`` (a refusal, an acknowledgement), then reads until the sink hangs up, as a
    collector does."""
    connection.sendall(data)
    connection.settimeout(5)
    try:
        while connection.recv(1 << 16):  # until the sink hangs up, as a collector does
            pass
    except OSError:
        pass


def _refuse_then_reset(connection, index):
    with connection:
        connection.recv(1 << 16)
        if index % 2:  # refuse, saying why
            _answer(connection, Refusal.of(Reason.TOKEN).pack())
        # else hang up without a word: the sink sees a reset


@pytest.mark.timeout(60)
def test_a_refusal_alternating_with_resets_is_reported_once(caplog):
    fickle = FakeCollector(_refuse_then_reset)
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink = SocketSink("127.0.0.1", fickle.port, run="fickle")
        sink.emit(TapRecord(name="r", value=1))
        wait_until(lambda: fickle.connections >= 5, timeout=40)  # three refusals
        sink.close(timeout=0)
    fickle.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("wrong or missing token" in message for message in warnings) == 1


def test_a_refusal_holds_its_text_where_older_senders_read_it_then_its_code():
    refusal = Refusal.of(Reason.RECORD_TOO_LARGE, 1000, size=2006)
    data = refusal.pack()
    text = b"a record of 2006 bytes is over the collector's limit of 1000 bytes"
    # What a sender from before the codes reads: the marker, the text's length, the text.
    assert data[:ACK.size + REASON.size + len(text)] == \
        ACK.pack(REFUSED) + REASON.pack(len(text)) + text
    assert Refusal.size_of(data) == len(data)
    assert Refusal.unpack(data) == refusal
    assert (refusal.reason, refusal.limit) == (Reason.RECORD_TOO_LARGE, 1000)
    without_code = data[:ACK.size + REASON.size + len(text)]  # as a collector before the codes
    assert Refusal.unpack(without_code) == Refusal(Reason.RECORD_TOO_LARGE, text.decode(), 1000)
    other = Refusal.of(Reason.TOKEN).pack()[:-REFUSAL_CODE.size]
    assert Refusal.unpack(other).reason is Reason.NO_CODE  # its text still reads
    assert Refusal.unpack(other).text == Refusal.of(Reason.TOKEN).text


def _refuse_with_a_future_code(connection, index):
    with connection:
        connection.recv(1 << 16)
        _answer(connection, Refusal(code=999, text="the collector is on fire").pack())


@pytest.mark.timeout(30)
def test_a_refusal_with_a_code_this_version_does_not_know_is_a_clear_error(caplog):
    newer = FakeCollector(_refuse_with_a_future_code)
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink = SocketSink("127.0.0.1", newer.port, run="newer")
        sink.emit(TapRecord(name="r", value=1))
        with pytest.raises(TimeoutError, match=r"reason code 999, which this version of "
                                               r"hostcallback does not know .* on fire"):
            sink.flush(timeout=5)
        sink.close(timeout=0)
    newer.close()
    assert sink.dropped == 0  # not taken for a refusal of one record: the record waits
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("reason code 999" in message for message in warnings) == 1


def _refuse_without_a_code(connection, index):
    with connection:
        connection.recv(1 << 16)
        reason = b"wrong or missing token"  # what a collector from before the codes sends
        _answer(connection, ACK.pack(REFUSED) + REASON.pack(len(reason)) + reason)


@pytest.mark.timeout(30)
def test_a_refusal_from_a_collector_older_than_the_codes_is_reported_with_its_text(caplog):
    older = FakeCollector(_refuse_without_a_code)
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink = SocketSink("127.0.0.1", older.port, run="older")
        sink.emit(TapRecord(name="r", value=1))
        with pytest.raises(TimeoutError, match="the collector refused this sink: wrong or "
                                               "missing token"):
            sink.flush(timeout=5)
        sink.close(timeout=0)
    older.close()
    assert sink.dropped == 0


def _acknowledge_more_than_was_sent(connection, index):
    with connection:
        connection.recv(1 << 16)
        _answer(connection, ACK.pack(1000))


@pytest.mark.timeout(30)
def test_an_acknowledgement_of_more_records_than_were_sent_is_an_error_and_forgets_none(caplog):
    liar = FakeCollector(_acknowledge_more_than_was_sent)
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        sink = SocketSink("127.0.0.1", liar.port, run="liar")
        for i in range(3):
            sink.emit(TapRecord(name="r", value=i))
        # Before the fix the flush returned: the acknowledgement deleted every buffered record.
        with pytest.raises(TimeoutError, match=r"acknowledged 1000 records on this connection "
                                               r"\(bytes b'.*'\), but [123] were sent on it"):
            sink.flush(timeout=3)
    assert sink.pending == 3 and sink.acknowledged == 0 and sink.dropped == 0
    assert sink.close(timeout=0) == 3
    liar.close()


def _trickle_after(connection, index, data: bytes) -> None:
    """Sends ``data``, then a byte every 0.1 s until the sink hangs up (or for 30 s)."""
    with connection:
        connection.recv(1 << 16)
        connection.sendall(data)
        try:
            for _ in range(300):
                time.sleep(0.1)
                connection.sendall(b"x")
        except OSError:
            pass


def _refuse_with_4_gib_of_text(connection, index):
    _trickle_after(connection, index, ACK.pack(REFUSED) + REASON.pack(0xFFFF_FFFF))


@pytest.mark.timeout(30)
def test_a_refusal_over_its_size_limit_is_an_error_not_4_gib_to_read():
    liar = FakeCollector(_refuse_with_4_gib_of_text)
    sink = SocketSink("127.0.0.1", liar.port, run="liar")
    for i in range(3):
        sink.emit(TapRecord(name="r", value=i))
    # Before the fix the sending thread went on reading the text (a byte at a time, each within
    # its one-second timeout), so the flush timed out without a word of why.
    with pytest.raises(TimeoutError, match=f"a refusal of {0xFFFF_FFFF} bytes, over the "
                                           f"{MAX_REFUSAL_TEXT} a refusal may have"):
        sink.flush(timeout=3)
    assert sink.pending == 3 and sink.dropped == 0
    assert sink.close(timeout=0) == 3
    liar.close()


def _trickle_a_refusal(connection, index):
    _trickle_after(connection, index, ACK.pack(REFUSED) + REASON.pack(60_000))


@pytest.mark.timeout(30)
def test_a_refusal_that_trickles_in_is_taken_as_far_as_it_came_within_a_second():
    liar = FakeCollector(_trickle_a_refusal)
    sink = SocketSink("127.0.0.1", liar.port, run="liar")
    sink.emit(TapRecord(name="r", value=1))
    started = time.monotonic()
    # Before the fix: 60,000 bytes at ten a second, each within the one-second timeout.
    wait_until(lambda: sink.problem is not None, timeout=5, what="the sink to give up reading")
    assert time.monotonic() - started < 3
    assert re.fullmatch("the collector refused this sink: x+", sink.problem)
    assert sink.pending == 1 and sink.dropped == 0
    assert sink.close(timeout=0) == 1
    liar.close()


class _AckWhenTold:
    """Serves one connection: reads everything, and acknowledges ``count`` records when
    ``go`` is set (never more)."""

    def __init__(self, count):
        self.count, self.go = count, threading.Event()

    def __call__(self, connection, index):
        with connection:
            connection.settimeout(0.05)
            while True:
                try:
                    if not connection.recv(1 << 16):
                        return
                except TimeoutError:
                    pass
                except OSError:
                    return
                if self.go.is_set():
                    connection.sendall(ACK.pack(self.count))
                    self.go.clear()


@pytest.mark.timeout(30)
def test_flush_waits_for_the_records_emitted_before_it_not_for_later_ones():
    server = _AckWhenTold(count=3)
    collector = FakeCollector(server)
    sink = SocketSink("127.0.0.1", collector.port, run="busy")
    for i in range(3):
        sink.emit(TapRecord(name="r", value=i))

    def another_thread_emits_during_the_flush():
        # The sending thread never waits on the condition while records are pending, so a
        # waiter is the flush.
        wait_until(lambda: len(sink._cond._waiters) >= 1)
        sink.emit(TapRecord(name="r", value=3))  # never acknowledged
        server.go.set()

    helper = threading.Thread(target=another_thread_emits_during_the_flush)
    helper.start()
    sink.flush(timeout=10)  # before the fix: TimeoutError, waiting for record 3 as well
    helper.join()
    assert sink.acknowledged == 3 and sink.pending == 1
    assert sink.close(timeout=0) == 1
    collector.close()


def _accept_and_never_read(connection, index):
    time.sleep(30)
    connection.close()


@pytest.mark.timeout(30)
def test_close_stops_a_sending_thread_blocked_on_a_collector_that_does_not_read():
    stuck = FakeCollector(_accept_and_never_read)
    sink = SocketSink("127.0.0.1", stuck.port, run="stuck", ack_timeout=600)
    for _ in range(40):  # 40 MB: far more than the socket buffers hold
        sink.emit(TapRecord(name="r", value=np.zeros(250_000, np.float32)))
    wait_until(lambda: sink._sent > 0)  # the thread is in sendall
    assert sink.close(timeout=0.5) == 40
    wait_until(lambda: not sink._thread.is_alive(), timeout=5)  # before the fix: 60 s
    stuck.close()
