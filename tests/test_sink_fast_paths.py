"""The sinks' per-record fast paths give exactly what the general code gave."""

import ml_dtypes
import msgpack
import numpy as np

from consumer import stream
from consumer.sinks import scalar_series
from consumer.stream import TapRecord


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
