"""The record layout: round trips for every dtype, and corrupt bytes answered with WireFormatError."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostcallback import wire


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


def test_the_cpp_encoder_and_this_decoder_agree_on_the_version():
    from hostcallback._native import outfeed

    assert outfeed.WIRE_VERSION == wire.VERSION
