"""Frames put together in C++ for a batch (hostcallback.consumer.frame_templates) are byte for
byte the general encoder's, or are not used."""

import ast
import dataclasses
import io
import os
import time
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax, tree_util

import hostcallback as hcb
from helpers import run_python
from hostcallback._native import outfeed
from hostcallback._records.registry import Consumer
from hostcallback.addons import LEAVES, RecordBatch
from hostcallback.consumer import FileSink, SinkTap, tap_to
from hostcallback.consumer.frame_templates import make_template, step_of
from hostcallback.consumer.native_frames import frames
from hostcallback.consumer.stream import TapRecord, frame_item
from hostcallback.consumer.stream_files import read_records, read_stream, stream_files

_FIELDS = {"name": "train", "metadata": {"lr": 0.5, "tags": ["a"]}, "process": 1, "host": "h",
           "device": "TFRT_CPU_0", "device_id": 0}


def _batch(values, sequences=None, transforms=()):
    """Records as a receiver drains them, with the consumer of their tap site."""
    treedef = tree_util.tree_structure(values[0])
    consumer = Consumer(func=lambda arg, transforms: None, treedef=treedef,
                        transforms=tuple(transforms))
    sequences = sequences or list(range(len(values)))
    records = [(1, 0, sequence, 0, tuple(np.ascontiguousarray(leaf) for leaf in
                                         tree_util.tree_leaves(value)))
               for value, sequence in zip(values, sequences)]
    return RecordBatch(records, 0, len(records), consumer, device=None)


def _with_leaves(batch, index: int, leaves: tuple) -> None:
    """Gives one record of the batch other arrays (a record and its arrays are tuples)."""
    batch.records[index] = (*batch.records[index][:LEAVES], leaves)


def _with_leaf(batch, index: int, leaf_index: int, leaf) -> None:
    leaves = batch.records[index][LEAVES]
    _with_leaves(batch, index, leaves[:leaf_index] + (leaf,) + leaves[leaf_index + 1:])


def _general_frames(batch, now):
    return [frame_item(TapRecord(value=value, step=step_of(value), sequence=sequence, time=now,
                                 transforms=list(batch.transforms), **_FIELDS).to_map())
            for value, sequence in zip(batch.values(), batch.sequences())]


def _assert_same_frames(values, sequences=None, transforms=()):
    batch = _batch(values, sequences, transforms)
    template = make_template(batch, _FIELDS)
    assert template is not None
    assert template.frames(batch, now=1234.5) == _general_frames(batch, 1234.5)


_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
           np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
           ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4]


@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (0,), (1, 0, 2)], ids=str)
def test_frames_of_every_dtype_and_shape_match_the_general_encoder(dtype, shape):
    values = [{"step": np.array(i, np.int32),
               "x": np.arange(int(np.prod(shape)) or 0).reshape(shape).astype(dtype) + i}
              for i in range(3)]
    _assert_same_frames(values)


_EDGES = [0, 1, 31, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32,
          -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                   np.uint32, np.uint64, np.bool_], ids=lambda d: d.__name__)
def test_steps_and_sequences_are_packed_as_msgpack_packs_python_ints(dtype):
    info = np.iinfo(dtype) if dtype is not np.bool_ else None
    steps = [s for s in _EDGES if info is None and s in (0, 1)
             or info is not None and info.min <= s <= info.max]
    values = [{"step": np.array(s, dtype), "loss": np.float32(s)} for s in steps]
    _assert_same_frames(values, sequences=[abs(s) for s in steps])
    _assert_same_frames(values[:1], sequences=[2**64 - 1])


@pytest.mark.parametrize("value", [
    np.float32(1.5),
    {"loss": np.float32(1.0)},  # no step: nil
    {"step": np.array([5, 6], np.int64), "x": np.ones(2)},  # a step that is not 0-d
    (np.ones(2), [np.int8(3), {"b": np.zeros((2, 2))}]),
    {"a": {"b": {"c": np.float64(2)}}, "step": np.uint8(9)},
    {"step": None, "x": np.float32(1)},
], ids=["scalar", "no-step", "vector-step", "containers", "nested", "none-step"])
def test_frames_of_every_value_shape_taps_deliver_match(value):
    leaves, treedef = tree_util.tree_flatten(value)
    values = [tree_util.tree_unflatten(treedef, [np.asarray(leaf) + i for leaf in leaves])
              for i in range(3)]
    _assert_same_frames(values, transforms=[("batch", {"batch_dims": (0,)}), ("jvp", {})])


@dataclasses.dataclass
class _Node:
    a: np.ndarray


tree_util.register_pytree_node(_Node, lambda n: ((n.a,), None), lambda _, c: _Node(*c))


@pytest.mark.parametrize("value", [
    {"step": np.float32(3), "x": np.ones(2)},  # int() of a float: framed in Python
    {"step": np.zeros(0, np.int32), "x": np.ones(2)},  # a step with no element
    _Node(np.ones(2)),  # written by its repr
    {"step": {"inner": np.int32(1)}},  # a step that is not a leaf
], ids=["float-step", "empty-step", "custom-node", "dict-step"])
def test_values_the_pieces_cannot_describe_get_no_template(value):
    assert make_template(_batch([value]), _FIELDS) is None


class _Scaled:
    """A pytree node whose unflatten computes with its children (it cannot hold hole markers)."""

    def __init__(self, a):
        self.a = a * 1.0

    def __repr__(self):
        return f"_Scaled({self.a.tolist()})"


tree_util.register_pytree_node(_Scaled, lambda n: ((n.a,), None), lambda _, c: _Scaled(*c))


def test_a_node_that_computes_with_its_children_gets_no_template_and_its_records_are_written(
        tmp_path):
    batch = _batch([_Scaled(np.ones(2, np.float32) * i) for i in range(3)])
    assert make_template(batch, _FIELDS) is None
    sink = FileSink(tmp_path / "s.hcbs")
    SinkTap([sink], "t").tap_batch(batch)
    sink.close()
    assert [r.value for r in read_records(tmp_path / "s.hcbs")] == [
        "_Scaled([0.0, 0.0])", "_Scaled([1.0, 1.0])", "_Scaled([2.0, 2.0])"]


def test_the_time_is_the_wall_clock_when_a_record_is_framed():
    batch = _batch([{"x": np.float32(1)}])
    before = time.time()
    (data,) = make_template(batch, _FIELDS).frames(batch)
    after = time.time()
    (record,) = read_records(io.BytesIO(data))
    assert before <= record.time <= after


def test_a_record_that_does_not_fit_its_template_is_refused():
    batch = _batch([{"x": np.ones(3, np.float32)}, {"x": np.ones(3, np.float32)}])
    template = make_template(batch, _FIELDS)
    _with_leaf(batch, 1, 0, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="template's shape"):
        template.frames(batch)
    _with_leaf(batch, 1, 0, np.ones(6, np.float32)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        template.frames(batch)
    _with_leaf(batch, 1, 0, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="not a numpy array"):
        template.frames(batch)
    _with_leaves(batch, 1, batch.records[1][LEAVES] + (np.ones(3, np.float32),))
    with pytest.raises(ValueError, match="template's arrays"):
        template.frames(batch)


@pytest.mark.parametrize("other", [np.arange(6, dtype=np.int32).reshape(2, 3),
                                   np.arange(6, dtype=np.float32),
                                   np.arange(6, dtype=np.float32).reshape(2, 3).astype(">f4")],
                         ids=["dtype", "shape", "byte-order"])
def test_a_record_of_the_same_size_but_another_dtype_or_shape_is_refused(other):
    batch = _batch([{"x": np.ones((2, 3), np.float32)}, {"x": np.ones((2, 3), np.float32)}])
    template = make_template(batch, _FIELDS)
    _with_leaf(batch, 1, 0, other)
    with pytest.raises(ValueError, match="template's (dtype|shape)"):
        template.frames(batch)


def test_bad_arguments_to_frame_records_are_value_errors():
    records = [(1, 0, 0, 0, (np.ones(1, np.float32),))]
    spec = ([np.dtype(np.float32)], [(1,)])
    with pytest.raises(ValueError, match="piece"):
        frames.frame_records(records, 0, 1, [b""], *spec, -1, "i", 8)
    with pytest.raises(ValueError, match="outside"):
        frames.frame_records(records, 0, 2, [b""] * 5, *spec, -1, "i", 8)
    with pytest.raises(ValueError, match="step"):
        frames.frame_records(records, 0, 1, [b""] * 5, *spec, 0, "f", 4)
    with pytest.raises(ValueError, match="one dtype and one shape"):
        frames.frame_records(records, 0, 1, [b""] * 5, spec[0], [], -1, "i", 8)
    with pytest.raises(ValueError, match="template's arrays"):
        frames.frame_records([("not", "a", "record")], 0, 1, [b""] * 5, *spec, -1, "i", 8)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 1000, 1 << 16])
def test_the_crc_is_zlibs(size):
    data = os.urandom(size)
    assert frames.crc32(data) == zlib.crc32(data)


def test_a_run_whose_later_records_do_not_fit_its_template_is_framed_in_python(tmp_path):
    sink = FileSink(tmp_path / "s.hcbs")
    tap = SinkTap([sink], "t")
    batch = _batch([{"step": np.int32(i), "x": np.ones(2, np.float32) * i} for i in range(2)])
    tap.tap_batch(batch)
    _with_leaf(batch, 1, 1, np.arange(2, dtype=np.int32))  # same size, another dtype
    tap.tap_batch(batch)
    sink.close()
    values = [r.value["x"] for r in read_records(tmp_path / "s.hcbs")]
    assert [(v.dtype.name, v.tolist()) for v in values] == [
        ("float32", [0, 0]), ("float32", [1, 1]), ("float32", [0, 0]), ("int32", [0, 1])]


def test_one_tap_function_traced_for_values_of_several_dtypes_and_shapes_writes_each_right(
        tmp_path, transport):
    sink = FileSink(tmp_path / "s.hcbs")

    def step(x, s):
        return tap_to([sink], {"step": s, "x": x}, name="t")["x"]

    values = [jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.arange(6, dtype=jnp.int32),
              jnp.arange(6, dtype=jnp.float32), jnp.float32(7)]
    for index in range(12):
        jax.jit(step)(values[index % 4], jnp.float32(index) if index == 11 else index)
    hcb.barrier_wait()
    sink.close()
    records = list(read_records(tmp_path / "s.hcbs"))
    assert [r.step for r in records] == list(range(12))
    for index, record in enumerate(records):
        expected = np.asarray(values[index % 4])
        assert record.value["x"].dtype == expected.dtype
        np.testing.assert_array_equal(record.value["x"], expected)


def test_tapped_records_reach_a_file_in_order_with_their_values(tmp_path, transport):
    sink = FileSink(tmp_path / "s.hcbs")

    def body(i, c):
        return tap_to([sink], {"step": i, "loss": c, "grad": jnp.full((3,), c)},
                      name="train")["loss"] + 1.0

    jax.jit(lambda x: lax.fori_loop(0, 3000, body, x))(jnp.float32(0))
    hcb.barrier_wait()
    sink.close()
    records = list(read_records(tmp_path / "s.hcbs"))
    assert [r.step for r in records] == list(range(3000))
    assert [float(r.value["loss"]) for r in records] == list(range(3000))
    assert all(r.value["grad"].tolist() == [float(r.value["loss"])] * 3 for r in records)


def test_a_rotating_file_sink_rotates_frame_by_frame_under_batches(tmp_path):
    sink = FileSink(tmp_path / "s.hcbs", max_bytes=20_000, backup_count=100)
    jax.jit(lambda x: lax.fori_loop(0, 2000, lambda i, c: tap_to(
        [sink], {"step": i, "x": c}, name="t")["x"] + 1, x))(jnp.float32(0))
    hcb.barrier_wait()
    sink.close()
    files = stream_files(tmp_path / "s.hcbs")
    assert len(files) > 5 and all(os.path.getsize(f) <= 20_000 for f in files)
    assert [r.step for r in read_stream(tmp_path / "s.hcbs")] == list(range(2000))


def test_a_records_list_shortened_while_large_frames_are_filled_is_refused_not_read_past():
    """Large frames are filled without the GIL; another thread may shorten the list meanwhile."""
    result = run_python("""
        import threading
        import numpy as np
        from hostcallback.consumer.native_frames import frames
        big = np.zeros(1 << 17, np.uint8)  # over the size above which the GIL is released
        spec = ([np.uint8], [[1 << 17]])
        outcomes = set()
        for _ in range(200):
            records = [(1, 0, i, 0, (big,)) for i in range(64)]
            shrink = threading.Thread(target=lambda: [records.pop() for _ in range(64)])
            shrink.start()
            try:
                frames.frame_records(records, 0, 64, [b""] * 5, *spec, -1, "i", 8)
                outcomes.add("framed")
            except ValueError as error:
                outcomes.add(str(error))
            shrink.join()
        print(sorted(outcomes - {"framed"}))
        """, devices=1)
    assert result.returncode == 0, result.stderr[-2000:]
    refusals = set(ast.literal_eval(result.stdout))  # framed whole, or refused before or while
    assert refusals <= {"records was shortened while it was being framed",
                        "start:stop is outside records"}


def test_without_the_compiled_framer_sinks_frame_in_python_and_say_so_once(tmp_path):
    """A broken install that lacks hostcallback.consumer._frames still writes every record."""
    result = run_python(f"""
        import sys
        sys.modules["hostcallback.consumer._frames"] = None  # its import now fails
        import jax, jax.numpy as jnp
        import hostcallback as hcb
        from hostcallback.consumer import FileSink, tap_to
        from hostcallback.consumer.stream_files import read_stream
        sink = FileSink({str(tmp_path / "s.hcbs")!r})
        step = jax.jit(lambda i: tap_to([sink], {{"step": i, "loss": i * 1.0}}, name="t"))
        for i in range(50):
            step(i)
        hcb.barrier_wait()
        sink.close()
        print([r.step for r in read_stream({str(tmp_path / "s.hcbs")!r})] == list(range(50)))
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]
    assert result.stderr.count("consumer extension (hostcallback.consumer._frames) cannot") == 1


def test_the_consumers_extension_takes_only_the_cores_exit_gate():
    with pytest.raises(TypeError, match="exit_gate"):
        frames.share_exit_gate(object())
    with pytest.raises(TypeError, match="exit_gate"):
        frames.share_exit_gate(outfeed.registrations()["hostcallback_tap"])
