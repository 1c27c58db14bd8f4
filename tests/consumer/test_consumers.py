"""Consumers: the record stream, file/logging/stats/socket sinks and the collector, for real."""

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from helpers import run_python, wait_until
from hostcallback.consumer import (
    FileSink,
    LoggingSink,
    SocketSink,
    StatsSink,
    StreamFormatError,
    TapRecord,
    read_records,
    stream,
    tap_to,
)
from hostcallback.consumer.collector import CollectorThread


@pytest.fixture
def collector_server(tmp_path):
    server = CollectorThread(tmp_path / "collected").start()
    yield server
    server.stop()


def test_every_dtype_round_trips_through_a_stream_file(tmp_path):
    sink = FileSink(tmp_path / "taps.hcbs")
    values = {str(np.dtype(d)): (np.arange(6) % 4).astype(d).reshape(2, 3) for d in [
        np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.float16,
        ml_dtypes.bfloat16, np.float32, np.complex64, ml_dtypes.float8_e4m3fn]}
    jax.jit(lambda v: tap_to([sink], v, name="all_dtypes", metadata={"run_kind": "test"}))(values)
    hcb.barrier_wait()
    (record,) = read_records(tmp_path / "taps.hcbs")
    assert record.name == "all_dtypes" and record.metadata == {"run_kind": "test"}
    for key, value in values.items():
        got = record.value[key]
        assert got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8))


def test_records_carry_step_device_sequence_process_and_time(tmp_path):
    sink = FileSink(tmp_path / "taps.hcbs")
    step = jax.jit(lambda s: tap_to([sink], {"step": s, "loss": s * 0.5}, name="train"))
    for s in range(3):
        step(s)
    hcb.barrier_wait()
    records = list(read_records(tmp_path / "taps.hcbs"))
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.sequence for r in records] == sorted(r.sequence for r in records)
    assert all(r.device == str(jax.devices()[0]) and r.device_id == 0 for r in records)
    assert all(r.process == 0 and r.host and r.time > 0 for r in records)


def test_a_torn_last_record_leaves_every_complete_record_readable(tmp_path):
    records = [TapRecord(name="x", value=np.arange(i + 1)) for i in range(5)]
    data = stream.dumps(records)
    path = tmp_path / "torn.hcbs"
    path.write_bytes(data[:-7])
    assert [len(r.value) for r in read_records(path)] == [1, 2, 3, 4]


def test_a_stream_from_a_newer_version_is_refused_clearly(tmp_path):
    path = tmp_path / "future.hcbs"
    path.write_bytes(stream.pack({"format": stream.FORMAT, "version": 99}))
    with pytest.raises(StreamFormatError, match="stream version 99 is not supported"):
        list(read_records(path))


def test_a_file_that_is_not_a_stream_is_refused_clearly(tmp_path):
    path = tmp_path / "other.bin"
    path.write_bytes(stream.pack({"hello": "world"}))
    with pytest.raises(StreamFormatError, match="does not start with a hostcallback header"):
        list(read_records(path))


def test_file_sink_rotates_and_keeps_every_record(tmp_path):
    path = tmp_path / "rotating.hcbs"
    sink = FileSink(path, max_bytes=4096, backup_count=50)
    jax.jit(lambda x: lax.fori_loop(0, 40, lambda i, c: (tap_to([sink], jnp.full(100, i),
                                                                 name="big"), c)[1], x))(0)
    hcb.barrier_wait()
    files = sorted(tmp_path.glob("rotating.hcbs*"))
    assert len(files) > 3
    assert all(os.path.getsize(f) <= 4096 for f in files)
    steps = sorted(int(r.value[0]) for f in files for r in read_records(f))
    assert steps == list(range(40))


def _emit_steps(sink, steps, size=100):
    """Records written through the sink as a receiver hands them over."""
    for step in steps:
        sink.emit(TapRecord(name="big", value={"x": np.full(size, step, np.float32)},
                            step=step))


def test_file_sink_rotation_deletes_only_past_backup_count_and_says_so(tmp_path, caplog):
    path = tmp_path / "kept.hcbs"
    sink = FileSink(path, max_bytes=2000, backup_count=2)  # a few records a file
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        _emit_steps(sink, range(40))
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["kept.hcbs", "kept.hcbs.1", "kept.hcbs.2"]
    kept = sorted(r.step for f in files for r in read_records(f))
    assert kept == list(range(40 - len(kept), 40))  # the newest, none missing between
    deleted = [r.message for r in caplog.records if "its oldest file" in r.message]
    assert len(deleted) == 1 and "backup_count=2" in deleted[0]


@pytest.mark.parametrize("settings", [{"max_bytes": 2000, "backup_count": 0},
                                      {"max_bytes": -1}])
def test_file_sink_refuses_a_rotation_that_would_keep_no_file(tmp_path, settings):
    with pytest.raises(ValueError, match="backup_count >= 1"):
        FileSink(tmp_path / "s.hcbs", **settings)


def test_file_sink_writes_on_when_its_file_is_moved_away_before_a_rotation(tmp_path, caplog):
    path = tmp_path / "moved.hcbs"
    sink = FileSink(path, max_bytes=2000)
    _emit_steps(sink, range(2))
    os.remove(path)  # a cleanup job, say: the rotation's rename fails
    with caplog.at_level(logging.WARNING, logger="hostcallback.sinks"):
        _emit_steps(sink, range(2, 30))
    assert sum("could not rotate" in r.message for r in caplog.records) == 1
    steps = sorted(r.step for f in tmp_path.iterdir() for r in read_records(f))
    # Those written to the removed file before the rotation went with it; every later one is kept.
    assert steps == list(range(steps[0], 30)) and len(steps) >= 15


def test_file_sink_on_a_full_disk_loses_exactly_the_records_it_says(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: a write that crosses it is short, then fails.
    The records whose write failed are said lost and are not in the file, even once there is
    room again; every other record reads back, and no torn frame is left between them."""
    path = tmp_path / "full.hcbs"
    result = run_python(f"""
        import json, resource, signal
        import numpy as np
        from hostcallback.consumer import FileSink, TapRecord
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        sink = FileSink({str(path)!r})
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        failed = []
        for step in range(25):
            if step == 20:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
            elif step == 4:
                resource.setrlimit(resource.RLIMIT_FSIZE, (3000, hard))
            try:
                sink.emit(TapRecord(name="x", value={{"v": np.zeros(100, np.float32)}},
                                    step=step))
            except OSError as error:
                assert "they are lost" in str(error), error
                failed.append(step)
        sink.close()
        print(json.dumps(failed))
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    failed = json.loads(result.stdout.splitlines()[-1])
    assert failed and 20 not in failed
    skipped = []
    steps = [r.step for r in read_records(path, skipped)]
    assert steps == [step for step in range(25) if step not in failed]
    assert skipped == []


def test_file_sink_is_flushed_by_barrier_wait(tmp_path):
    sink = FileSink(tmp_path / "flushed.hcbs")
    jax.jit(lambda x: tap_to([sink], x, name="x"))(1.0)
    hcb.barrier_wait()
    assert len(list(read_records(tmp_path / "flushed.hcbs"))) == 1  # the sink is still open


def test_file_sink_is_flushed_at_exit(tmp_path):
    path = tmp_path / "exit.hcbs"
    result = run_python(f"""
        import jax
        from jax import lax
        from hostcallback.consumer import FileSink, tap_to
        sink = FileSink({str(path)!r})
        body = lambda i, c: (tap_to([sink], i, name="i"), c)[1]
        jax.jit(lambda x: lax.fori_loop(0, 25, body, x))(0)
        """, devices=1)
    assert result.returncode == 0, result.stderr
    assert [int(r.value) for r in read_records(path)] == list(range(25))


def test_logging_sink_logs_one_summarised_record_per_tap(caplog):
    with caplog.at_level(logging.INFO, logger="hostcallback.taps"):
        jax.jit(lambda x: tap_to([LoggingSink()], {"step": 7, "w": x}, name="weights"))(
            jnp.arange(100.0))
        hcb.barrier_wait()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "hostcallback.taps"]
    assert message.startswith("weights step=7 device=")
    assert "float32[100] mean=49.5 min=0 max=99" in message


def test_stats_sink_keeps_count_mean_min_max_last():
    stats = StatsSink()
    jax.jit(lambda x: lax.fori_loop(
        0, 4, lambda i, c: (tap_to([stats], {"step": i, "loss": 10.0 - i}, name="train"), c)[1],
        x))(0)
    hcb.barrier_wait()
    assert stats.summary() == {"train.loss": {
        "count": 4, "mean": 8.5, "min": 7.0, "max": 10.0, "last": 7.0}}


@pytest.mark.parametrize("losses", [[0.5, math.nan, 0.25], [math.nan, 1.0]],
                         ids=["NaN later", "NaN first"])
def test_stats_sink_min_and_max_are_nan_once_a_value_is_as_the_mean(losses):
    stats = StatsSink()
    for loss in losses:
        stats.emit(TapRecord(name="train", value={"loss": np.float32(loss)}))
    summary = stats.summary()["train.loss"]
    assert all(math.isnan(summary[key]) for key in ("mean", "min", "max"))


def test_socket_sink_streams_to_the_collector_tagged_with_its_source(collector_server):
    sink = SocketSink("127.0.0.1", collector_server.port, run="unit")
    body = lambda i, c: (tap_to([sink], {"step": i}, name="s"), c)[1]
    jax.jit(lambda x: lax.fori_loop(0, 30, body, x))(0)
    hcb.barrier_wait()
    sink.close()
    path = collector_server.collector.path_for("unit")
    wait_until(lambda: collector_server.collector.records_written >= 30)
    records = list(read_records(path))
    assert sorted(r.step for r in records) == list(range(30))
    assert {r.source for r in records} == {f"{socket.gethostname()}:{os.getpid()}/p0"}


@pytest.mark.timeout(60)
def test_socket_sink_waits_for_a_collector_that_starts_late_and_blocks_when_full(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sink = SocketSink("127.0.0.1", port, run="late", max_buffered_bytes=2000)
    emitted = threading.Event()

    def emit_many():
        for i in range(20):
            sink.emit(TapRecord(name="n", value=np.full(50, i)))  # about 260 bytes each
        emitted.set()

    threading.Thread(target=emit_many, daemon=True).start()
    wait_until(lambda: sink.waits > 0)  # the buffer is full and nothing can be sent yet
    assert not emitted.is_set()
    server = CollectorThread(tmp_path / "late", port=port).start()
    try:
        assert emitted.wait(20)
        assert sink.close() == 0  # every record acknowledged, so written
        records = list(read_records(server.collector.path_for("late")))
        assert [int(r.value[0]) for r in records] == list(range(20))
        assert sink.waits > 0 and sink.wait_seconds > 0
    finally:
        server.stop()


def test_collector_keeps_complete_records_from_a_client_that_disconnects_mid_record(
        collector_server):
    good = stream.frame_item(stream.stream_header(run="torn", sender="raw", first=0)) + b"".join(
        stream.frame_item(TapRecord(name=n, value=v).to_map()) for n, v in [("a", np.arange(3)),
                                                                            ("b", 1)])
    torn = stream.frame_item(TapRecord(name="c", value=np.arange(1000)).to_map())
    with socket.create_connection(("127.0.0.1", collector_server.port)) as client:
        client.sendall(good + torn[:100])
    sink = SocketSink("127.0.0.1", collector_server.port, run="torn")  # the server lives on
    sink.emit(TapRecord(name="d", value=2))
    sink.close()
    wait_until(lambda: collector_server.collector.records_written >= 3)
    names = [r.name for r in read_records(collector_server.collector.path_for("torn"))]
    assert sorted(names) == ["a", "b", "d"]


def _consumer_cli(*args):
    return subprocess.run([sys.executable, "-m", "hostcallback.consumer", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def training_stream(tmp_path):
    path = tmp_path / "train.hcbs"
    records = [TapRecord(name="train", step=s, value={"step": np.int32(s),
                                                      "loss": np.float32(1.0 / (s + 1))})
               for s in range(10)]
    path.write_bytes(stream.dumps(records))
    return path


def test_cli_tail_prints_records_like_id_print(training_stream):
    result = _consumer_cli("tail", str(training_stream))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "name: train step: 0" and lines[1] == "{ loss=1. step=0 }"
    assert len(lines) == 20


def test_cli_stats_prints_a_summary_table(training_stream):
    result = _consumer_cli("stats", str(training_stream))
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split() == ["name", "count", "mean", "min", "max", "last"]
    assert row.split()[:2] == ["train.loss", "10"] and row.split()[3] == "0.1"


def test_cli_plot_draws_a_series_against_step(training_stream, tmp_path):
    output = tmp_path / "loss.png"
    result = _consumer_cli("plot", str(training_stream), "--name", "train.loss", "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_names_the_missing_series(training_stream, tmp_path):
    result = _consumer_cli("plot", str(training_stream), "--name", "nope", "-o",
                           str(tmp_path / "x.png"))
    assert result.returncode == 1 and "no series named 'nope'" in result.stderr


@pytest.mark.timeout(60)
def test_cli_collect_serves_until_stopped(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "hostcallback.consumer", "collect", "--port",
                               str(port), "--out", str(tmp_path / "cli")])
    try:
        sink = SocketSink("127.0.0.1", port, run="cli")
        sink.emit(TapRecord(name="x", value=1))
        sink.close()
        path = tmp_path / "cli" / "cli.hcbs"
        wait_until(lambda: path.exists() and list(read_records(path)), timeout=30)
        assert [r.name for r in read_records(path)] == ["x"]
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.timeout(60)
def test_socket_sink_reconnects_when_the_collector_restarts(tmp_path):
    first = CollectorThread(tmp_path / "first").start()
    port = first.port
    sink = SocketSink("127.0.0.1", port, run="restart")
    sink.emit(TapRecord(name="before", value=1))
    sink.flush()
    wait_until(lambda: first.collector.records_written >= 1)
    first.stop()  # the connection drops
    for i in range(5):
        sink.emit(TapRecord(name="after", value=i))
    second = CollectorThread(tmp_path / "second", port=port).start()
    try:
        sink.close()
        wait_until(lambda: second.collector.records_written >= 5)
        after = [int(r.value) for r in read_records(second.collector.path_for("restart"))
                 if r.name == "after"]
        before = [r.name for r in read_records(first.collector.path_for("restart"))]
    finally:
        second.stop()
    assert before == ["before"]
    assert after == list(range(5))


@pytest.mark.timeout(60)
def test_cli_tail_follows_a_growing_file(tmp_path):
    path = tmp_path / "growing.hcbs"
    sink = FileSink(path)
    follower = subprocess.Popen([sys.executable, "-m", "hostcallback.consumer", "tail", "--follow",
                                 str(path)], stdout=subprocess.PIPE, text=True)
    try:
        for i in range(3):
            sink.emit(TapRecord(name="grow", step=i, value=np.int32(i)))
            sink.flush()
        lines = [follower.stdout.readline().strip() for _ in range(6)]
    finally:
        follower.terminate()
        follower.wait(10)
        sink.close()
    assert lines == ["name: grow step: 0", "0", "name: grow step: 1", "1",
                     "name: grow step: 2", "2"]


@pytest.mark.needs_internals("partitioned=True")
def test_tap_to_takes_id_tap_options_and_refuses_unknown_keywords(tmp_path, transport):
    sink = FileSink(tmp_path / "t.hcbs")
    mesh = jax.make_mesh((4,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.device_put(jnp.arange(8.0), sharding)
    jax.jit(lambda v: tap_to([sink], v, name="shard", partitioned=True,
                             metadata={"kind": "p"}))(x)
    hcb.barrier_wait()
    sink.close()
    records = list(read_records(tmp_path / "t.hcbs"))
    assert sorted(r.value.tolist() for r in records) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {r.device_id for r in records} == {0, 1, 2, 3}
    assert all(r.metadata == {"kind": "p"} for r in records)
    with pytest.raises(TypeError, match="partitoned.*metadata=\\{'partitoned': ...\\}"):
        tap_to([sink], 1.0, name="typo", partitoned=True)


@pytest.mark.parametrize(("sinks", "name", "message"), [
    ("runs/loss.hcbs", "loss", "not a path .*FileSink\\('runs/loss.hcbs'\\)"),
    ([print], "loss", "takes sinks .*got builtin_function_or_method"),
    (3, "loss", "a list of sinks .*got int"),
    (FileSink, "loss", "not the class FileSink: make one"),
    ([StatsSink], "loss", "not the class StatsSink: make one"),
    ([], 7, "name as a str, not int"),
], ids=["a path", "a function", "a number", "a sink class", "a sink class in a list",
        "a name that is not a str"])
def test_tap_to_refuses_what_is_not_a_sink_when_traced(sinks, name, message):
    with pytest.raises(TypeError, match=message):
        jax.jit(lambda x: tap_to(sinks, x, name=name)).lower(1.0)


def test_tap_to_takes_one_sink_as_a_list_of_one(tmp_path):
    sink = FileSink(tmp_path / "one.hcbs")
    jax.jit(lambda x: tap_to(sink, x, name="one"))(1.0)
    hcb.barrier_wait()
    sink.close()
    assert [r.value for r in read_records(tmp_path / "one.hcbs")] == [1.0]


@pytest.mark.parametrize("max_bytes", [0, 1 << 20], ids=["one file", "rotating"])
def test_a_process_killed_after_its_steps_loses_none_of_its_file_sinks_records(tmp_path,
                                                                                 max_bytes):
    path = tmp_path / "killed.hcbs"
    result = run_python(f"""
        import os, signal
        import jax, jax.numpy as jnp
        from hostcallback.consumer import FileSink, tap_to
        sink = FileSink({str(path)!r}, max_bytes={max_bytes})
        step = jax.jit(lambda s: (tap_to([sink], {{"step": s, "loss": s * 0.5}}, name="train"),
                                  s + 1)[1])
        s = jnp.int32(0)
        for _ in range(100):
            s = step(s).block_until_ready()  # ready: its tap was handled
        os.kill(os.getpid(), signal.SIGKILL)
        """, devices=1)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert [r.step for r in read_records(path)] == list(range(100))
