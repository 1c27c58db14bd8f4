"""The record layout: round trips for every dtype, corrupt bytes answered with WireFormatError,
and the C++ encoder's records byte for byte the Python twin's, padding included."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import TEST_PLATFORM, drain_one, fresh_queue
from hostcallback._native import outfeed
from hostcallback._records import wire

leaf = wire.as_leaf


@pytest.mark.parametrize("dtype", sorted(wire.DTYPE_BY_CODE.values(), key=str))
def test_every_wire_dtype_round_trips_exactly(dtype):
    value = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    record = wire.decode_record(wire.encode_record(5, 1, 9, [value, value[:0]]))
    assert (record.consumer_id, record.device, record.sequence) == (5, 1, 9)
    got, empty = record.arrays
    assert got.dtype == value.dtype and got.shape == value.shape and empty.shape == (0, 3, 4)
    np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8))


def test_scalars_stay_scalars():
    (got,) = wire.decode_record(wire.encode_record(1, 0, 0, [np.float32(2.5)])).arrays
    assert got.shape == () and got == 2.5


def test_payloads_start_64_byte_aligned():
    data = wire.encode_record(1, 0, 0, [np.ones(3, np.int8), np.ones(5, np.float64)])
    buffer = np.zeros(len(data) + 64, np.uint8)
    start = (-buffer.ctypes.data) % 64
    buffer[start:start + len(data)] = np.frombuffer(data, np.uint8)
    for array in wire.decode_record(buffer[start:start + len(data)]).arrays:
        assert array.ctypes.data % 64 == 0


def test_unsupported_dtypes_name_the_supported_ones():
    with pytest.raises(wire.UnsupportedDtypeError, match="supported dtypes are"):
        wire.dtype_code(np.dtype("U3"))


@pytest.mark.parametrize("corrupt,message", [
    (lambda b: b[:20], "shorter than"),
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + struct.pack("<H", 99) + b[6:], "wire version 99"),
    (lambda b: b[:-64], "record says it has"),
    (lambda b: b[:20] + struct.pack("<I", 10_000) + b[24:], "cannot fit"),
])
def test_corrupt_records_raise_wire_format_errors(corrupt, message):
    good = wire.encode_record(3, 0, 0, [np.arange(10, dtype=np.int32)])
    with pytest.raises(wire.WireFormatError, match=message):
        wire.decode_record(corrupt(good))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        wire.decode_record(data)
    except wire.WireFormatError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.integers(0, 10_000), st.data())
def test_mutated_and_truncated_records_never_crash_the_decoder(byte, cut, data):
    good = bytearray(wire.encode_record(3, 1, 2, [np.arange(12, dtype=np.float32).reshape(3, 4),
                                                  np.ones((2, 2), np.int8)]))
    position = data.draw(st.integers(0, len(good) - 1))
    good[position] = byte
    try:
        wire.decode_record(bytes(good[:max(0, len(good) - cut % 300)]))
    except wire.WireFormatError:
        pass


def test_a_record_begins_as_the_wire_format_document_says():
    """Magic b"HCB1", version 1, flags, then the consumer id (docs/wire-format.md): the
    constants both sides read from the core are the documented ones."""
    device = fresh_queue()
    outfeed.enqueue(device, 7, [leaf(np.float32(1.0))], platform=TEST_PLATFORM)
    raw = bytes(drain_one(device))
    assert raw[:4] == b"HCB1"
    assert struct.unpack_from("<HHQ", raw, 4) == (1, 0, 7)
    assert len(raw) % 64 == 0


ARRAY_SETS = [
    [np.arange(3, dtype=np.int8)],
    [np.float32(1.5), np.arange(7, dtype=np.int16).reshape(7, 1), np.zeros((0, 3), np.float64)],
    [np.ones(5, np.bool_), np.arange(33, dtype=np.uint8), np.full((2, 2), -1, np.int64)],
]


@pytest.mark.parametrize("arrays", ARRAY_SETS)
def test_the_cpp_and_python_encoders_give_identical_bytes(arrays):
    device = fresh_queue()
    outfeed.enqueue(device, 7, [leaf(a) for a in arrays], platform=TEST_PLATFORM)
    raw = drain_one(device)
    sequence = wire.decode_record(raw).sequence
    assert bytes(raw) == wire.encode_record(7, device, sequence, arrays)


# Each pair: a record of 0xFF bytes, then one of the same pooled size whose arrays leave gaps
# where the first had data (a 1-byte array, then the next one 63 bytes on).
RECYCLED = {
    "large": ([np.full(1 << 16, 0xFF, np.uint8)],
              [np.ones(1, np.uint8), np.full((1 << 16) - 64, 7, np.uint8)]),
    "small": ([np.full(128, 0xFF, np.uint8)], [np.ones(1, np.uint8), np.full(1, 7, np.uint8)]),
}


@pytest.mark.parametrize("old, new", RECYCLED.values(), ids=RECYCLED.keys())
def test_padding_in_a_recycled_buffer_is_zero(old, new):
    device = fresh_queue()
    outfeed.enqueue(device, 1, [leaf(a) for a in old], platform=TEST_PLATFORM)
    first = drain_one(device)
    assert first.size == len(wire.encode_record(1, device, 0, new))  # the same pooled size
    dirtied = first.__array_interface__["data"][0]
    del first  # back to the pool
    outfeed.enqueue(device, 2, [leaf(a) for a in new], platform=TEST_PLATFORM)
    raw = drain_one(device)
    assert raw.__array_interface__["data"][0] == dirtied  # the recycled buffer, not a fresh one
    assert bytes(raw) == wire.encode_record(2, device, 1, new)
