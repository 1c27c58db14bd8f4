"""Odd inputs that must still work, or fail clearly; corrupt streams never crash a reader."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hostcallback as hcb
from hostcallback._native import outfeed
from hostcallback._records import wire
from hostcallback.consumer import StreamFormatError, StreamReader, TapRecord, stream


def test_a_tap_of_a_donated_buffer_sees_the_value_before_donation(transport, collector):
    double = jax.jit(lambda x: hcb.id_tap(collector, x) * 2, donate_argnums=0)
    out = double(jnp.arange(4.0))
    hcb.barrier_wait()
    np.testing.assert_array_equal(collector.values[0], [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0, 6.0])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=1024))
def test_random_bytes_never_crash_the_stream_reader(data):
    reader = StreamReader(max_buffer_size=1 << 16)
    try:
        reader.feed(stream.pack(stream.stream_header()) + data)
    except StreamFormatError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.data())
def test_mutated_streams_give_records_or_a_clear_error(byte, data):
    good = bytearray(stream.dumps([TapRecord(name="x", value=np.arange(6).reshape(2, 3)),
                                   TapRecord(name="y", value={"a": (1, 2.5)})]))
    good[data.draw(st.integers(0, len(good) - 1))] = byte
    try:
        StreamReader(max_buffer_size=1 << 16).feed(bytes(good))
    except StreamFormatError:
        pass


def test_a_host_leaf_whose_shape_overflows_its_byte_count_is_refused():
    """2^62 float32 elements are 2^64 bytes: the count must not wrap around to 0 bytes."""
    float32 = wire.dtype_code(np.dtype(np.float32))
    with pytest.raises(ValueError, match="bytes do not match its shape"):
        outfeed.enqueue(0, 5, [(float32, [2**62], np.zeros(0, np.uint8))])
