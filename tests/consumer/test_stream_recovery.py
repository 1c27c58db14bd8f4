"""A damaged region never loses a whole stream file; rotated files read in order; tail follows
rotation."""

import io
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from helpers import wait_until
from hostcallback.consumer import FileSink, TapRecord, read_records, stream
from hostcallback.consumer import stream_files as stream_files_module
from hostcallback.consumer.stream import SkippedRange
from hostcallback.consumer.stream_files import follow_records, read_stream, stream_files

RECORDS = [TapRecord(name="x", step=i, value=np.arange(i + 1)) for i in range(10)]


def steps(records):
    return [r.step for r in records]


def offset_of_record(data: bytes, index: int) -> int:
    """Where record ``index`` (0-based, after the header frame) starts."""
    position = -1
    for _ in range(index + 2):
        position = data.find(stream.SYNC, position + 1)
    return position


def test_damaged_bytes_in_the_middle_lose_only_the_records_they_touch():
    data = bytearray(stream.dumps(RECORDS))
    start = offset_of_record(data, 4) + 20
    data[start:start + 8] = b"\xff" * 8
    skipped = []
    assert steps(read_records(io.BytesIO(bytes(data)), skipped)) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    (region,) = skipped
    assert region.start == offset_of_record(data, 4) and region.end == offset_of_record(data, 5)
    assert "CRC-32" in region.reason


def test_a_damaged_length_field_is_skipped_past():
    data = bytearray(stream.dumps(RECORDS))
    start = offset_of_record(data, 2)
    data[start + 4:start + 8] = (10 ** 6).to_bytes(4, "little")
    skipped = []
    assert steps(read_records(io.BytesIO(bytes(data)), skipped)) == [0, 1, 3, 4, 5, 6, 7, 8, 9]
    assert [(r.start, r.end) for r in skipped] == [(start, offset_of_record(data, 3))]


def test_a_torn_last_record_is_reported_and_the_rest_kept():
    data = stream.dumps(RECORDS)
    skipped = []
    assert steps(read_records(io.BytesIO(data[:-7]), skipped)) == list(range(9))
    assert skipped == [SkippedRange(offset_of_record(data, 9), len(data) - 7,
                                    "torn last record (the writer stopped mid-write)")]


def test_without_a_list_skipped_ranges_are_logged(caplog):
    data = bytearray(stream.dumps(RECORDS))
    data[offset_of_record(data, 1) + 15] ^= 0xFF
    assert len(list(read_records(io.BytesIO(bytes(data))))) == 9
    assert "skipped bytes" in caplog.text and "every intact record" in caplog.text


def test_a_damaged_first_header_loses_only_itself():
    data = bytearray(stream.dumps(RECORDS))
    data[stream.FRAME.size + 3] ^= 0xFF  # inside the header frame's payload
    skipped = []
    assert steps(read_records(io.BytesIO(bytes(data)), skipped)) == list(range(10))
    (region,) = skipped
    assert region.start == 0 and region.end == offset_of_record(data, 0)


def _version_1(records) -> bytes:
    return stream.pack({"format": stream.FORMAT, "version": 1}) + b"".join(
        stream.pack(r.to_map()) for r in records)


def test_version_1_files_still_read():
    assert steps(read_records(io.BytesIO(_version_1(RECORDS)))) == list(range(10))


def test_version_1_files_resynchronise_after_damage_too():
    data = bytearray(_version_1(RECORDS))
    name = b"\x8c\xa4name"
    third = data.find(name, data.find(name, data.find(name) + 1) + 1)
    data[third + 8:third + 12] = b"\xc1\xc1\xc1\xc1"
    skipped = []
    assert steps(read_records(io.BytesIO(bytes(data)), skipped)) == [0, 1, 3, 4, 5, 6, 7, 8, 9]
    assert len(skipped) == 1


def test_a_file_sink_appending_to_a_version_1_file_keeps_both_readable(tmp_path):
    path = tmp_path / "old.hcbs"
    path.write_bytes(_version_1(RECORDS[:3]))
    sink = FileSink(path)
    sink.emit(RECORDS[3])
    sink.close()
    assert steps(read_records(path)) == [0, 1, 2, 3]


def test_random_damage_never_loses_a_record_it_does_not_touch():
    rng = np.random.default_rng(0)
    clean = stream.dumps(RECORDS)
    bounds = [offset_of_record(clean, i) for i in range(10)] + [len(clean)]
    for _ in range(200):
        data = bytearray(clean)
        where = int(rng.integers(bounds[0], len(data)))
        data[where] ^= int(rng.integers(1, 256))
        touched = next(i for i in range(10) if bounds[i] <= where < bounds[i + 1])
        got = list(read_records(io.BytesIO(bytes(data)), []))
        # Every byte of a frame is covered by its CRC-32: the touched record never comes back.
        assert steps(got) == [s for s in range(10) if s != touched]
        assert all(np.array_equal(r.value, RECORDS[r.step].value) for r in got)


def test_an_intact_record_holding_frame_bytes_across_a_chunk_boundary_is_read_whole():
    # A tapped byte buffer may hold a whole stream; read_records reads 1 MB chunks, and a
    # record longer than one must not be taken for a damaged length because of what it holds.
    inner = stream.dumps([TapRecord(name="fake", value=1)])
    payload = np.frombuffer(inner + bytes(2 << 20), np.uint8)
    data = stream.dumps([TapRecord(name="a", value=0), TapRecord(name="real", value=payload),
                         TapRecord(name="b", value=2)])
    skipped = []
    records = list(read_records(io.BytesIO(data), skipped))
    assert [r.name for r in records] == ["a", "real", "b"]
    assert np.array_equal(records[1].value, payload)
    assert skipped == []


def test_stream_files_lists_rotated_files_oldest_first(tmp_path):
    path = tmp_path / "rot.hcbs"
    sink = FileSink(path, max_bytes=600, backup_count=50)
    for record in RECORDS:
        sink.emit(record)
    sink.close()
    files = stream_files(path)
    assert len(files) > 3 and files[-1] == str(path)
    assert files[:-1] == sorted(files[:-1], key=lambda f: -int(f.rsplit(".", 1)[1]))
    assert steps(read_stream(path)) == list(range(10))


@pytest.mark.timeout(60)
def test_follow_records_follows_rotation(tmp_path):
    path = tmp_path / "follow.hcbs"
    sink = FileSink(path, max_bytes=600, backup_count=50)
    sink.emit(RECORDS[0])
    sink.flush()
    seen, done = [], threading.Event()

    def follow():
        for record in follow_records(path, poll_seconds=0.01, should_stop=done.is_set):
            seen.append(record.step)

    follower = threading.Thread(target=follow)
    follower.start()
    try:
        wait_until(lambda: seen == [0], what="following the file before it rotates")
        for record in RECORDS[1:]:
            sink.emit(record)
            sink.flush()
        sink.close()
        assert len(stream_files(path)) > 3  # it did rotate
        wait_until(lambda: len(seen) >= 10, what="following it across its rotations")
    finally:
        done.set()
        follower.join(10)
    assert seen == list(range(10))


def _follow_while(path, actions, monkeypatch) -> list[int]:
    """The steps follow_records yields of ``path`` while ``actions`` run, one at each of its
    looks for more (where it would sleep), in this thread: no timing involved."""
    done = []
    monkeypatch.setattr(stream_files_module.time, "sleep",
                        lambda _: actions.pop(0)() if actions else done.append(True))
    return steps(follow_records(path, should_stop=lambda: bool(done)))


@pytest.mark.parametrize("looked_between", [False, True],
                         ids=["written again at once", "seen cut before"])
def test_follow_records_reads_on_where_a_file_was_cut_back_in_place(tmp_path, monkeypatch,
                                                                     caplog, looked_between):
    """A collector whose write the disk took only in part (records 3 and 4 whole, half of 5)
    cuts its file back to where that write began and, once there is room, writes a segment
    header and records 3 to 6 again: a follower yields each record once, and no damage."""
    path = tmp_path / "cut.hcbs"
    frames = [stream.frame_item(TapRecord(name="x", step=i, sequence=i,
                                          value=np.arange(i + 1)).to_map()) for i in range(7)]
    file = open(path, "ab", buffering=0)  # noqa: SIM115 - written by the actions below
    file.write(stream.frame_item(stream.stream_header()) + b"".join(frames[:3]))
    cut = file.tell()

    def cut_back():
        os.truncate(path, cut)
        file.seek(cut)

    def write_again():
        file.write(stream.frame_item(stream.stream_header()) + b"".join(frames[3:]))

    actions = [lambda: file.write(frames[3] + frames[4] + frames[5][:len(frames[5]) // 2])]
    actions += [cut_back, write_again] if looked_between else \
        [lambda: (cut_back(), write_again())]
    with file:
        assert _follow_while(path, actions, monkeypatch) == list(range(7))
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]


def test_follow_records_goes_on_to_the_new_file_when_its_file_is_deleted(tmp_path,
                                                                         monkeypatch):
    """A cleanup job deletes the file followed; the sink's next rotation fails, and it opens
    the path again: the follower goes on there, not to the older rotated files."""
    path = tmp_path / "s.hcbs"
    sink = FileSink(path, max_bytes=250, backup_count=20)  # a record or two a file
    for record in RECORDS[:5]:
        sink.emit(record)
    assert (tmp_path / "s.hcbs.2").exists()
    already = steps(read_records(path))
    actions = [lambda: os.remove(path),
               lambda: [sink.emit(record) for record in RECORDS[5:]]]
    seen = _follow_while(path, actions, monkeypatch)
    assert seen == already + list(range(5, 10))


def test_cli_tail_of_a_damaged_file_reports_the_range_and_prints_the_rest(tmp_path):
    data = bytearray(stream.dumps(RECORDS))
    data[offset_of_record(data, 4) + 20] ^= 0xFF
    path = tmp_path / "damaged.hcbs"
    path.write_bytes(bytes(data))
    result = subprocess.run([sys.executable, "-m", "hostcallback.consumer", "tail", str(path)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert result.stdout.count("name: x") == 9
    (warning,) = result.stderr.strip().splitlines()
    assert "skipped bytes" in warning and "CRC-32" in warning


def test_following_resynchronises_past_a_damaged_length_with_intact_frames_inside_it(tmp_path):
    data = bytearray(stream.dumps(RECORDS))
    start = offset_of_record(data, 2)
    data[start + 4:start + 8] = (10 ** 6).to_bytes(4, "little")  # claims more than there is
    path = tmp_path / "live.hcbs"
    path.write_bytes(bytes(data))  # a live file: the writer may still be writing
    followed = list(follow_records(path, poll_seconds=0.01, should_stop=lambda: True))
    assert steps(followed) == [0, 1, 3, 4, 5, 6, 7, 8, 9]


def test_a_long_frame_still_arriving_is_waited_for_not_skipped():
    big = TapRecord(name="x", step=0, value=np.arange(100_000))
    data = stream.dumps([big, RECORDS[1]])
    reader = stream.StreamReader()
    got = []
    for position in range(0, len(data), 4096):
        got += reader.feed(data[position:position + 4096])
    assert steps(got + reader.finish()) == [0, 1] and reader.skipped == []


def test_a_frame_of_a_huge_container_is_skipped_as_damage_not_decoded():
    # {"name": "x", "value": [{}] * 4_000_000}: 3.8 MiB, and 527 MiB as Python objects
    huge = stream.frame(stream.pack({"name": "x", "value": [{}] * 4_000_000}))
    data = bytearray(stream.dumps(RECORDS))
    at = offset_of_record(data, 5)
    data[at:at] = huge
    skipped = []
    assert steps(read_records(io.BytesIO(bytes(data)), skipped)) == list(range(10))
    (region,) = skipped
    assert region.start == at and "exceeds max_array_len" in region.reason
