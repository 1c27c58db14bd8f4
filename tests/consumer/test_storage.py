"""Streams at fsspec URLs: FileSink writes parts to memory://, file:// and S3 (a real S3 API
server, moto's, on localhost), the readers and the CLI read them back, and a store that fails
is an error at barrier_wait that names the URL, with the records kept to try again."""

import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from helpers import ROOT, free_port, run_python
from hostcallback.consumer import FileSink, file_sink, stream, tap_to
from hostcallback.consumer.__main__ import main as cli
from hostcallback.consumer.storage import stream_parts
from hostcallback.consumer.stream import TapRecord
from hostcallback.consumer.stream_files import (
    expand_streams,
    follow_records,
    merged_records,
    read_records,
    read_stream,
)

fsspec = pytest.importorskip("fsspec", reason="streams at URLs need fsspec ('.[test]' has it)")


def _url(suffix: str = "") -> str:
    """A fresh stream URL on fsspec's in-memory filesystem (shared within this process)."""
    return f"memory://hcb-{uuid.uuid4().hex}/run{suffix}.hcbs"


def _tap_steps(sink, steps, name="loss", size=50):
    step = jax.jit(lambda i: tap_to([sink], {"step": i, "x": jnp.ones(size) * i}, name=name))
    for i in steps:
        step(i)


def test_a_sink_at_a_url_writes_parts_that_read_back_in_order():
    url = _url()
    sink = FileSink(url, part_bytes=2000)
    _tap_steps(sink, range(20))
    hcb.barrier_wait()
    parts = stream_parts(url)
    assert len(parts) > 2
    assert [part.rsplit("-", 1)[1] for part in parts] == [f"{n:06d}" for n in range(len(parts))]
    assert [r.step for r in read_stream(url)] == list(range(20))
    # Each part is a whole stream: readable alone, its records a run of the steps.
    first = [r.step for r in read_records(parts[0])]
    assert first and first == list(range(len(first)))


def test_a_barrier_writes_the_records_waiting_in_the_open_part():
    url = _url()
    sink = FileSink(url)  # 8 MiB parts: the records would wait
    _tap_steps(sink, range(3))
    hcb.barrier_wait()
    assert [r.step for r in read_stream(url)] == [0, 1, 2]
    _tap_steps(sink, range(3, 5))
    hcb.barrier_wait()
    assert [r.step for r in read_stream(url)] == [0, 1, 2, 3, 4]
    assert len(stream_parts(url)) == 2


def test_a_part_is_written_part_seconds_after_its_first_record_without_a_barrier():
    url = _url()
    sink = FileSink(url, part_seconds=0.3)
    _tap_steps(sink, range(2))
    jnp.zeros(()).block_until_ready()  # ready means handled: both records are in the part
    deadline = time.monotonic() + 30
    while not stream_parts(url, fresh=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r.step for r in read_stream(url)] == [0, 1]
    del sink


def test_process_and_host_placeholders_are_filled_in_at_the_first_record(tmp_path,
                                                                          monkeypatch):
    base = f"memory://hcb-{uuid.uuid4().hex}"
    at_url = FileSink(base + "/{host}/{process}.hcbs")
    local = FileSink(tmp_path / "{process}-{host}.hcbs")
    assert not list(tmp_path.iterdir())  # nothing opened yet
    # The process index as jax.distributed.initialize, called after the sinks were made, sets it.
    monkeypatch.setattr(file_sink, "process_index", lambda: 3)
    _tap_steps(at_url, [0])
    _tap_steps(local, [1])
    hcb.barrier_wait()
    assert [r.step for r in read_stream(f"{base}/{socket.gethostname()}/3.hcbs")] == [0]
    assert [r.step for r in read_stream(tmp_path / f"3-{socket.gethostname()}.hcbs")] == [1]


def test_a_sink_started_again_on_a_url_adds_parts_after_the_last():
    url = _url()
    _tap_steps(FileSink(url), range(3))
    hcb.barrier_wait()
    _tap_steps(FileSink(url), range(3, 6))
    hcb.barrier_wait()
    assert [r.step for r in read_stream(url)] == list(range(6))


def test_a_local_file_url_works_like_any_other(tmp_path):
    url = f"file://{tmp_path}/run.hcbs"
    _tap_steps(FileSink(url, part_bytes=2000), range(10))
    hcb.barrier_wait()
    assert [r.step for r in read_stream(url)] == list(range(10))
    assert (tmp_path / "run.hcbs.part-000000").exists()


def _records(sink, process, steps):
    """Records of another process (or host), written through the sink as a receiver would."""
    for step in steps:
        sink.emit(TapRecord(name="loss", value={"loss": float(step)}, step=step, process=process,
                            device_id=process * 2, sequence=step))


def test_a_glob_of_urls_reads_every_stream_merged_by_process_device_and_sequence():
    base = f"memory://hcb-{uuid.uuid4().hex}/run"
    # Named so that the glob lists process 1's stream first: only the merge puts process 0 first.
    sinks = [FileSink(f"{base}/{name}.hcbs", part_bytes=300) for name in ("b", "a")]
    for step in range(0, 10, 2):  # interleaved, as hosts write
        _records(sinks[1], 1, [step, step + 1])
        _records(sinks[0], 0, [step, step + 1])
    for sink in sinks:
        sink.close()
    streams = expand_streams([f"{base}/*.hcbs"])
    assert [stream.rsplit("/", 1)[-1] for stream in streams] == ["a.hcbs", "b.hcbs"]
    records = merged_records([f"{base}/*.hcbs"])
    assert [(r.process, r.step) for r in records] == \
        [(0, step) for step in range(10)] + [(1, step) for step in range(10)]


def test_merging_streams_that_each_hold_two_runs_keeps_each_run_whole(tmp_path):
    """The same program run twice appends to each process's file, its sequences from 0 again:
    the merge gives each process's first run, then its second, never the two interleaved."""
    for run in ("first", "second"):
        for process in (0, 1):
            sink = FileSink(tmp_path / f"{process}.hcbs")
            for step in range(3):
                sink.emit(TapRecord(name=run, value={"loss": 0.0}, step=step, process=process,
                                    device_id=process, sequence=step))
            sink.close()
    records = merged_records([str(tmp_path / "*.hcbs")])
    assert [(r.process, r.name, r.step) for r in records] == [
        (process, run, step) for process in (0, 1) for run in ("first", "second")
        for step in range(3)]


def test_merging_keeps_one_run_whose_senders_interleaved_their_batches(tmp_path):
    """A collected run fed by two sinks of one process (two taps of one device, sharing its
    sequence) holds batches 0,2,4 | 1,3,5 | 6,8 | 7,9: one run, merged in sequence order."""
    path = tmp_path / "run.hcbs"
    with open(path, "wb") as file:
        writer = stream.StreamWriter(file)
        for sequence in [0, 2, 4, 1, 3, 5, 6, 8, 7, 9]:
            writer.write(TapRecord(name="loss", value=0.0, process=0, device_id=0,
                                   sequence=sequence))
    assert [r.sequence for r in merged_records([str(path)])] == list(range(10))


def test_a_part_being_written_aside_is_no_stream_of_a_glob(tmp_path):
    url = f"file://{tmp_path}/run.hcbs"
    sink = FileSink(url)
    _records(sink, 0, range(3))
    sink.close()
    # What a writer killed between writing a part aside and linking it into place leaves.
    (tmp_path / ".run.hcbs.part-000001.0123.writing").write_bytes(
        (tmp_path / "run.hcbs.part-000000").read_bytes())
    for pattern in (f"file://{tmp_path}/*", str(tmp_path / "*")):
        assert [r.step for r in merged_records([pattern])] == [0, 1, 2]


def test_a_file_where_a_urls_folder_should_be_is_the_stores_error(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    sink = FileSink(f"file://{tmp_path}/taken/run.hcbs")
    _records(sink, 0, range(2))
    with pytest.raises(OSError, match="writing .*taken/run.hcbs failed .*File exists"):
        sink.flush()


def test_the_cli_tails_stats_and_plots_a_glob_of_urls(tmp_path, capsys):
    base = f"memory://hcb-{uuid.uuid4().hex}/run"
    for process in (0, 1):
        sink = FileSink(f"{base}/{process}.hcbs")
        _records(sink, process, range(4))
        sink.close()
    assert cli(["tail", f"{base}/*.hcbs"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("name: loss") == 8
    assert cli(["stats", f"{base}/*.hcbs"]) == 0
    assert "per source:" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert cli(["plot", f"{base}/*.hcbs", "-o", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_the_cli_says_when_a_glob_matches_nothing_or_several_streams_are_followed(capsys):
    base = f"memory://hcb-{uuid.uuid4().hex}/run"
    assert cli(["tail", f"{base}/*.hcbs"]) == 1
    assert "no stream matches" in capsys.readouterr().err
    for process in (0, 1):
        sink = FileSink(f"{base}/{process}.hcbs")
        _records(sink, process, range(1))
        sink.close()
    assert cli(["tail", "--follow", f"{base}/*.hcbs"]) == 2
    assert "--follow takes one stream; 2 were named" in capsys.readouterr().err


def test_following_a_stream_at_a_url_reads_each_part_as_it_is_written():
    url = _url()
    sink = FileSink(url)
    done = threading.Event()

    def write():
        for step in range(5):
            _records(sink, 0, [step])
            sink.flush()  # one part a step
            time.sleep(0.05)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    seen = [r.step for r in follow_records(url, poll_seconds=0.02, should_stop=done.is_set)]
    writer.join()
    assert seen == list(range(5))


@pytest.mark.parametrize("store", ["memory", "file"])
def test_two_sinks_on_one_url_never_overwrite_each_others_parts(store, tmp_path):
    """Two processes writing one URL (no ``{process}`` in it), or a restarted one while the old
    one still flushes: each part is written anew, never over another's."""
    url = _url() if store == "memory" else f"file://{tmp_path}/run.hcbs"
    sinks = [FileSink(url), FileSink(url)]
    for step in range(6):
        for process, sink in enumerate(sinks):
            _records(sink, process, [step])
            sink.flush()  # one part each, numbered from the same first listing
    records = sorted((r.process, r.step) for r in read_stream(url))
    assert records == [(p, step) for p in (0, 1) for step in range(6)]


def test_a_follower_of_a_local_url_never_reads_a_part_half_written(tmp_path):
    url = f"file://{tmp_path}/run.hcbs"
    sink = FileSink(url, part_bytes=1 << 30)
    listening, stop = threading.Event(), threading.Event()
    seen = []

    def follow():
        listening.set()
        seen.extend(r.step for r in follow_records(url, poll_seconds=0.001,
                                                   should_stop=stop.is_set))

    follower = threading.Thread(target=follow)
    follower.start()
    listening.wait()
    for step in range(200):  # one part of 20 MB, written at the flush while the follower polls
        sink.emit(TapRecord(name="w", value={"w": np.zeros(25_000, np.float32)}, step=step))
    sink.flush()
    stop.set()
    follower.join(60)
    assert seen == list(range(200))


def test_part_settings_must_be_positive():
    for settings in ({"part_bytes": 0}, {"part_seconds": 0}, {"buffer_bytes": -1}):
        sink = FileSink(_url(), **settings)
        with pytest.raises(ValueError, match="must be positive"):
            _records(sink, 0, [0])


def test_without_fsspec_a_url_is_refused_saying_what_to_install():
    result = run_python("""
        import sys
        sys.modules["fsspec"] = None
        from hostcallback.consumer import FileSink
        try:
            FileSink("memory://run.hcbs")
        except ImportError as error:
            print(error)
        """, cwd=ROOT)
    assert "pip install 'hostcallback[storage]'" in result.stdout, result.stderr


# ---- S3, through s3fs, on moto's S3 API server on localhost ----------------------------------


@pytest.fixture
def s3(monkeypatch):
    """An S3 API server on localhost with a bucket; its settings in the environment (for the
    processes the test starts too). Yields a function that restarts it on the same port."""
    pytest.importorskip("s3fs", reason="S3 streams need s3fs ('.[test]' has it)")
    server_module = pytest.importorskip("moto.server", reason="needs moto[server]")
    port = free_port()
    servers = [server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port,
                                                verbose=False)]
    servers[0].start()
    settings = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                "AWS_MAX_ATTEMPTS": "2"}  # a stopped server fails a write in seconds
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    fsspec.config.set_conf_env(fsspec.config.conf)  # fsspec read its environment on import
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"hcb-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)

    class Server:
        name = bucket

        @staticmethod
        def stop():
            servers[-1].stop()

        @staticmethod
        def start():
            servers.append(server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port,
                                                            verbose=False))
            servers[-1].start()

    yield Server
    servers[-1].stop()
    fsspec.config.conf.pop("s3", None)


def test_a_sink_writes_its_parts_to_s3(s3):
    url = f"s3://{s3.name}/run/{{process}}.hcbs"
    sink = FileSink(url, part_bytes=3000)
    _tap_steps(sink, range(10))
    hcb.barrier_wait()
    assert [r.step for r in read_stream(f"s3://{s3.name}/run/0.hcbs")] == list(range(10))


def test_a_bucket_that_does_not_exist_is_an_error_at_the_barrier_naming_the_url(s3):
    sink = FileSink(f"s3://{s3.name}-missing/run.hcbs")
    _tap_steps(sink, [0])
    with pytest.raises(hcb.CallbackException) as caught:
        hcb.barrier_wait()
    assert f"s3://{s3.name}-missing/run.hcbs" in str(caught.value)
    assert "1 record(s) kept to try again" in str(caught.value)
    with pytest.raises(OSError, match="closed with 1 record\\(s\\) its store did not take"):
        sink.close()  # gives up; a sink still open would fail every later barrier
    hcb.barrier_wait()


def test_records_written_while_the_server_is_down_are_kept_and_written_once_it_is_back(s3):
    url = f"s3://{s3.name}/run.hcbs"
    sink = FileSink(url)
    _tap_steps(sink, range(3))
    hcb.barrier_wait()
    s3.stop()
    _tap_steps(sink, range(3, 6))
    with pytest.raises(hcb.CallbackException, match="3 record\\(s\\) kept to try again"):
        hcb.barrier_wait()
    s3.start()
    hcb.barrier_wait()  # the kept part is written now
    assert [r.step for r in read_stream(url)] == list(range(6))


def test_past_its_bound_a_sink_drops_the_oldest_parts_and_says_how_many(s3):
    url = f"s3://{s3.name}/run.hcbs"
    sink = FileSink(url, part_bytes=1500, buffer_bytes=4000)
    s3.stop()
    try:
        _tap_steps(sink, range(30))
        with pytest.raises(hcb.CallbackException, match="dropped so far"):
            hcb.barrier_wait()
    finally:
        s3.start()
    hcb.barrier_wait()
    steps = [r.step for r in read_stream(url)]
    assert steps == list(range(30 - len(steps), 30))  # the newest kept, in order
    assert len(steps) + sink.dropped == 30


@pytest.mark.timeout(300)
def test_two_processes_write_their_streams_to_s3_and_the_cli_merges_them(s3, capsys):
    """Two processes joined with jax.distributed, each writing s3://bucket/run/{process}.hcbs
    through s3fs; the CLI reads the glob as one run: every (process, device, step) once."""
    worker = ROOT / "tests" / "trace" / "multiprocess_worker.py"
    coordinator, steps = free_port(), 20
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    workers = [subprocess.Popen(
        [sys.executable, str(worker), str(coordinator), str(process),
         f"s3://{s3.name}/run/{{process}}.hcbs", str(steps)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for process in range(2)]
    outputs = [w.communicate(timeout=240)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
    pattern = f"s3://{s3.name}/run/*.hcbs"
    assert len(expand_streams([pattern])) == 2
    records = merged_records([pattern])
    keys = [(r.process, r.device_id, r.step) for r in records]
    assert len(keys) == len(set(keys)) == 4 * steps
    assert keys == sorted(keys, key=lambda k: (k[0], k[1]))
    assert cli(["stats", pattern]) == 0
    assert "per source:" in capsys.readouterr().out


def test_a_local_glob_names_each_stream_once_with_its_rotated_files(tmp_path):
    for process, name in ((0, "b"), (1, "a")):  # the glob lists process 1's stream first
        sink = FileSink(tmp_path / f"{name}.hcbs", max_bytes=400)  # a few records a file
        _records(sink, process, range(6))
        sink.close()
    assert (tmp_path / "b.hcbs.1").exists()
    assert expand_streams([tmp_path / "*.hcbs"]) == [str(tmp_path / "a.hcbs"),
                                                     str(tmp_path / "b.hcbs")]
    records = merged_records([str(tmp_path / "*.hcbs")])
    assert [(r.process, r.step) for r in records] == \
        [(0, step) for step in range(6)] + [(1, step) for step in range(6)]


@pytest.mark.parametrize("where", ["local", "url"])
def test_a_stream_whose_name_holds_glob_characters_is_read_by_that_name(tmp_path, capsys,
                                                                        where):
    name = "sweep[lr=0.1].hcbs"
    path = str(tmp_path / name) if where == "local" else _url().replace("run.hcbs", name)
    sink = FileSink(path)
    _records(sink, 0, range(3))
    sink.close()
    assert expand_streams([path]) == [path]
    assert cli(["tail", path]) == 0
    assert capsys.readouterr().out.count("name: loss") == 3
