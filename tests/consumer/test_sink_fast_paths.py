"""The sinks' per-record fast paths give exactly what the general code gave."""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest

import hostcallback as hcb
from hostcallback.consumer import (
    FileSink,
    FrameSink,
    Sink,
    SinkTap,
    SocketSink,
    TapRecord,
    read_records,
    stream,
    tap_to,
)
from hostcallback.consumer.collector import CollectorThread
from hostcallback.consumer.record_framer import RecordFramer
from hostcallback.consumer.stats_sink import scalar_series
from hostcallback.consumer.stream import frame_item


def test_to_map_writes_every_field_of_a_record():
    record = TapRecord(name="n", value={"x": np.ones(2)}, metadata={"k": 1}, step=3,
                       transforms=[("batch", {"batch_dims": (0,)})], source="s")
    fields = record.to_map()
    assert set(fields) == set(stream._RECORD_FIELDS)
    assert TapRecord.from_map(fields).step == 3 and TapRecord.from_map(fields).source == "s"


def test_a_non_contiguous_array_is_written_in_c_order():
    array = np.arange(12, dtype=np.int32).reshape(3, 4).T
    encoded = stream.encode_value(array)
    np.testing.assert_array_equal(stream.decode_value(encoded), array)


def test_a_dict_with_non_string_keys_keeps_its_keys():
    value = {1: np.float32(2), "a": np.float32(3)}
    assert stream.decode_value(stream.encode_value(value)) == value


def test_the_reused_packer_packs_as_packb_does():
    item = {"a": [1, 2.5, b"x", "y"], "b": {"c": None}}
    assert stream.pack(item) == msgpack.packb(item, use_bin_type=True)
    assert stream.pack(item) == stream.pack(item)  # a reused packer starts afresh each time


def test_series_come_from_real_numbers_only():
    record = TapRecord(name="t", value={"step": np.int32(1), "f": np.float32(2),
                                        "b": np.array(1.5, ml_dtypes.bfloat16),
                                        "c": np.complex64(1j), "v": np.arange(4.0)})
    assert scalar_series(record) == {"t.f": 2.0, "t.b": 1.5, "t.v": 1.5}


def test_zero_d_arrays_make_series_as_numpy_scalars_do():
    scalars = {"step": np.int32(1), "f": np.float32(2), "b": ml_dtypes.bfloat16(1.5),
               "i": np.int64(-3), "c": np.complex64(1j), "t": np.bool_(True),
               "nested": {"u": np.uint8(7)}, "pair": (np.float16(0.5), np.float64(4))}
    arrays = {key: np.asarray(value) if not isinstance(value, (dict, tuple)) else value
              for key, value in scalars.items()}
    arrays["nested"] = {"u": np.array(7, np.uint8)}
    arrays["pair"] = (np.array(0.5, np.float16), np.array(4.0))
    expected = {"t.f": 2.0, "t.b": 1.5, "t.i": -3.0, "t.nested.u": 7.0, "t.pair[0]": 0.5,
                "t.pair[1]": 4.0}
    assert scalar_series(TapRecord(name="t", value=scalars)) == expected
    assert scalar_series(TapRecord(name="t", value=arrays)) == expected


# ---- RecordFramer: the frames SinkTap hands to FileSink and SocketSink -------------------------

_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
           np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
           ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4]
_SHAPES = [(), (1,), (3,), (2, 3), (0,), (2, 0, 4), (1, 1, 1, 1)]


def _array(dtype, shape):
    return np.arange(int(np.prod(shape)) or 0).reshape(shape).astype(dtype)


def _values():
    """Values as taps deliver them (dicts of arrays) and everything else a sink accepts."""
    yield {"step": np.array(7, np.int32), "loss": np.array(0.5, np.float32)}
    for dtype in _DTYPES:
        for shape in _SHAPES:
            yield {"x": _array(dtype, shape)}
            yield _array(dtype, shape)
    yield {"big": np.ones(1 << 15, np.float32), "small": np.float32(1)}  # over the small limit
    yield np.ones((300, 300))
    yield np.arange(12.0).reshape(3, 4).T  # not C-contiguous
    yield np.arange(6.0).reshape(2, 3)[:, ::2]
    yield {"outer": {"inner": np.ones(2), "none": None}, "list": [np.int8(1), 2.5, "s"]}
    yield (np.ones(2), {"a": np.zeros(1)})
    yield [np.ones(2), None]
    yield {1: np.ones(2), "a": np.zeros(1)}  # not all keys are str
    yield {"a": np.zeros(1), 2: np.ones(2)}  # the first key is str, a later one not
    yield {}
    yield None
    yield 3
    yield -2**40
    yield 1.5
    yield "text"
    yield b"raw"
    yield np.float32(2.5)  # a numpy scalar, not an array
    yield np.ma.masked_array([1.0, 2.0])  # an ndarray subclass
    yield np.array(["ab", "c"])
    yield jnp.arange(3)  # a jax.Array that reached a sink


_FIELDS = [
    {"metadata": {}, "step": None, "device": "", "device_id": -1, "sequence": -1,
     "transforms": ()},
    {"metadata": {"lr": 0.1, "tags": ["a", "b"], "arr": np.ones(2)}, "step": 12345678901,
     "device": "TFRT_CPU_3", "device_id": 3, "sequence": 2**40,
     "transforms": (("batch", {"batch_dims": (0, None)}), ("jvp",))},
]


@pytest.mark.parametrize("fields", _FIELDS, ids=["bare", "metadata-and-transforms"])
def test_the_framer_writes_the_frame_of_the_tap_record_byte_for_byte(fields):
    framer = RecordFramer("train", fields["metadata"], 2, "host-a")
    for value in _values():
        expected = frame_item(TapRecord(
            name="train", value=value, metadata=dict(fields["metadata"]), step=fields["step"],
            process=2, host="host-a", device=fields["device"], device_id=fields["device_id"],
            sequence=fields["sequence"], time=1234.5,
            transforms=list(fields["transforms"])).to_map())
        for _ in range(2):  # the first time fills the caches, the second reads them
            assert framer.frame(value, fields["step"], fields["device"], fields["device_id"],
                                fields["sequence"], 1234.5, fields["transforms"]) == expected, \
                repr(value)


def test_a_framed_record_reads_back_with_its_values():
    value = {"step": np.array(3, np.int32), "g": np.arange(6, dtype=ml_dtypes.bfloat16)}
    data = RecordFramer("n", {"k": 1}, 0, "h").frame(value, 3, "cpu", 0, 9, 1.0, ())
    (record,) = stream.StreamReader().feed(frame_item(stream.stream_header()) + data)
    assert (record.name, record.step, record.sequence, record.metadata) == ("n", 3, 9, {"k": 1})
    np.testing.assert_array_equal(record.value["g"], value["g"])


def test_transforms_of_a_new_tuple_are_packed_again():
    framer = RecordFramer("n", {}, 0, "h")
    first = framer.frame(None, None, "", -1, 0, 0.0, (("jvp",),))
    second = framer.frame(None, None, "", -1, 0, 0.0, (("transpose",),))
    assert TapRecord.from_map(msgpack.unpackb(second[stream.FRAME.size:])).transforms == \
        [("transpose",)] and first != second


# ---- SinkTap: frames to FrameSinks, TapRecords to the others -----------------------------------


class _GeneralFileSink(FileSink):
    """A FileSink whose emit is overridden, so SinkTap hands it TapRecords (the general path)."""

    def emit(self, record):
        super().emit(record)


def _record_frames(path):
    """The record frames of a stream file, as bytes, leaving out its headers."""
    data, frames, position = path.read_bytes(), [], 0
    while position < len(data):
        _, length, _ = stream.FRAME.unpack_from(data, position)
        end = position + stream.FRAME.size + length
        if "format" not in msgpack.unpackb(data[position + stream.FRAME.size:end]):
            frames.append(data[position:end])
        position = end
    return frames


_TIME_FIELD = b"\xa4time\xcb"  # the "time" key and a float64's type byte


def _payloads_but_time(frames):
    """Each frame's payload with the record's time (the host's clock when it framed the record,
    which differs between sinks fed by batches) zeroed: every other byte must be equal."""
    out = []
    for data in frames:
        payload = data[stream.FRAME.size:]
        at = payload.index(_TIME_FIELD) + len(_TIME_FIELD)
        assert payload.count(_TIME_FIELD) == 1
        out.append(payload[:at] + bytes(8) + payload[at + 8:])
    return out


@pytest.mark.timeout(120)
@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_a_file_sink_fed_frames_writes_what_the_general_path_writes(tmp_path):
    fast, general = FileSink(tmp_path / "fast.hcbs"), _GeneralFileSink(tmp_path / "general.hcbs")
    sinks = [fast, general]

    def body(i, x):
        value = {"step": 3 * i + 1,  # a step that is not the sequence number
                 "loss": x, "grid": jnp.full((2, 3), x, jnp.bfloat16),
                 "flag": x > 2, "count": jnp.int8(i)}
        return tap_to(sinks, value, name="train", metadata={"lr": 0.01})["loss"] + 1.0

    jax.jit(lambda x: jax.lax.fori_loop(0, 20, body, x))(jnp.float32(0))
    jax.jit(jax.vmap(lambda x: tap_to(sinks, {"v": x}, name="batched")))(jnp.ones((3, 2)))
    hcb.barrier_wait()
    fast.close()
    general.close()
    records = list(read_records(tmp_path / "fast.hcbs"))
    assert len(records) == 21
    assert records[5].value["grid"].dtype == ml_dtypes.bfloat16
    assert records[5].value["grid"].shape == (2, 3)
    fast_frames = _record_frames(tmp_path / "fast.hcbs")
    assert len(fast_frames) == 21
    assert _payloads_but_time(fast_frames) == \
        _payloads_but_time(_record_frames(tmp_path / "general.hcbs"))


@pytest.mark.parametrize("value", [
    np.arange(3, dtype=">i4"), np.array([1.5, -2], ">f4"), np.array([1 + 2j], ">c8"),
    np.array(["ab", "c"]), np.array([b"xy"]), np.array(["é"], ">U1"),
    np.array([1, 2], "M8[s]"),
], ids=lambda value: value.dtype.str)
def test_the_fast_path_and_the_general_path_agree_on_every_dtype_they_write(value):
    framer = RecordFramer("d", {}, process=0, host="h")
    for tapped in (value, {"k": value}):
        fast = framer.frame(tapped, None, "cpu:0", 0, 1, 2.0, ())
        general = frame_item(TapRecord(name="d", value=tapped, process=0, host="h",
                                       device="cpu:0", device_id=0, sequence=1,
                                       time=2.0).to_map())
        assert fast == general


@pytest.mark.timeout(120)
def test_a_socket_sink_fed_frames_sends_what_the_general_path_writes(tmp_path):
    server = CollectorThread(tmp_path / "collected").start()
    try:
        sink = SocketSink("127.0.0.1", server.port, run="fast")
        general = _GeneralFileSink(tmp_path / "general.hcbs")
        jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda i, c: tap_to(
            [sink, general], {"step": 3 * i + 1, "x": c}, name="t")["x"] * 2.0, x))(jnp.ones(3))
        hcb.barrier_wait()
        assert sink.close() == 0
        general.close()
        frames = _record_frames(Path(server.collector.path_for("fast")))
        assert len(frames) == 10
        assert _payloads_but_time(frames) == \
            _payloads_but_time(_record_frames(tmp_path / "general.hcbs"))
    finally:
        server.stop()


def test_sink_tap_builds_frames_for_frame_sinks_and_records_for_the_others():
    seen = []

    class Frames(FrameSink):
        def emit_frame(self, data, name):
            seen.append(("frame", data, name))

    class Records(Sink):
        def emit(self, record):
            seen.append(("record", frame_item(record.to_map()), record.name))

    SinkTap([Frames(), Records(), Frames()], "t", k=1)({"x": np.ones(2)}, ())
    assert [kind for kind, _, _ in seen] == ["frame", "record", "frame"]
    assert seen[0][1] == seen[1][1] == seen[2][1] and seen[0][2] == "t"


@pytest.mark.timeout(120)
def test_a_failing_sink_does_not_keep_the_others_from_a_batch(tmp_path):
    class Failing(Sink):
        def emit(self, record):
            raise OSError("disk on fire")

    class FailingFrames(FrameSink):
        def emit_frame(self, data, name):
            raise OSError("socket on fire")

    stream_file = FileSink(tmp_path / "s.hcbs")
    sinks = [Failing(), FailingFrames(), stream_file]
    jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, c: tap_to(
        sinks, {"step": i, "x": c}, name="t")["x"] + 1, x))(jnp.float32(0))
    with pytest.raises(hcb.CallbackException, match="on fire"):
        hcb.barrier_wait()
    stream_file.close()
    assert [r.step for r in read_records(tmp_path / "s.hcbs")] == list(range(200))


def test_a_failing_sink_does_not_keep_the_others_from_a_record_and_the_tap_is_named():
    seen = []

    class Failing(Sink):
        def emit(self, record):
            raise OSError("disk on fire")

    class Records(Sink):
        def emit(self, record):
            seen.append(record.name)

        def __repr__(self):
            return "Records()"

    tap = SinkTap([Failing(), Records()], "loss")
    with pytest.raises(OSError, match="disk on fire"):
        tap(np.float32(1), ())
    assert seen == ["loss"]
    assert repr(tap).startswith("tap_to('loss') to [<") and repr(tap).endswith(", Records()]")


def test_a_frame_that_fails_does_not_keep_the_later_frames_of_a_batch_out():
    written = []

    class Picky(FrameSink):
        def emit_frame(self, data, name):
            if data == b"bad":
                raise ValueError("bad frame")
            written.append(data)

    with pytest.raises(ValueError, match="bad frame"):
        Picky().emit_frames([b"a", b"bad", b"b", b"bad", b"c"], "t")
    assert written == [b"a", b"b", b"c"]


def test_a_frame_sink_that_overrides_emit_gets_tap_records():
    class Counting(FrameSink):
        def __init__(self):
            self.records = []

        def emit(self, record):
            self.records.append(record)

    sink = Counting()
    SinkTap([sink], "t")({"step": np.array(4)}, ())
    assert [(r.name, r.step) for r in sink.records] == [("t", 4)]


def test_a_closed_file_sink_refuses_a_frame(tmp_path):
    sink = FileSink(os.path.join(tmp_path, "s.hcbs"))
    sink.close()
    with pytest.raises(ValueError, match="is closed"):
        SinkTap([sink], "t")({"x": np.ones(1)}, ())
