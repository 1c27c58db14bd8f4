"""Every array a record holds reads back as it was tapped (values and dtype); one whose dtype
no reader could decode is refused when it is written, saying why."""

import io

import ml_dtypes
import numpy as np
import pytest

from hostcallback.consumer import TapRecord, read_records, stream


def _read_back(value):
    (record,) = read_records(io.BytesIO(stream.dumps([TapRecord(name="d", value=value)])))
    return record.value


@pytest.mark.parametrize("dtype", [">f4", ">i4", ">c8", ">f8", ">u2", ">M8[s]"])
def test_an_array_in_big_endian_order_reads_back_with_its_values(dtype):
    array = np.arange(1, 5).astype(dtype)
    got = _read_back(array)
    np.testing.assert_array_equal(got, array)
    assert got.dtype == array.dtype.newbyteorder("=")  # written in native order


@pytest.mark.parametrize("array", [np.array(["ab", "c"]), np.array([b"xy", b"z"]),
                                   np.array(["é", "ü"], ">U1")], ids=["str", "bytes", "big-str"])
def test_string_arrays_read_back(array):
    got = _read_back(array)
    assert got.dtype.kind == array.dtype.kind and got.tolist() == array.tolist()


def test_native_arrays_keep_the_bytes_they_always_had():
    for dtype in (np.float32, np.int8, np.bool_, ml_dtypes.bfloat16, np.complex64):
        array = np.ones((2, 3), dtype)
        encoded = stream.encode_value(array)
        assert encoded["__ndarray__"] == np.dtype(dtype).name
        assert encoded["data"] == array.tobytes()


@pytest.mark.parametrize("array", [np.zeros(2, [("a", "<i4"), ("b", "<f4")]),
                                   np.array([1, "a"], dtype=object), np.zeros(2, "V8")],
                         ids=["structured", "object", "void"])
def test_an_array_no_reader_could_decode_is_refused_when_written(array):
    with pytest.raises(TypeError, match=r"cannot record an array of dtype .*: a reader could not "
                                        r"decode"):
        stream.dumps([TapRecord(name="d", value={"x": array})])
