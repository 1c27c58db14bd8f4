"""TensorBoardSink: what it writes, read back from the event files with tensorboardX's protobuf."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from helpers import run_python
from hostcallback.consumer import TapRecord, TensorBoardSink, tap_to
from hostcallback.consumer.tensorboard import event_files, read_events, read_scalars


def test_scalars_are_tagged_by_tap_name_and_path_at_the_tapped_step(tmp_path):
    sink = TensorBoardSink(tmp_path)
    step = jax.jit(lambda s: tap_to([sink], {"step": s, "loss": 1.0 / (s + 1),
                                             "parts": {"a": s * 2.0}}, name="train"))
    for s in range(3):
        step(s)
    hcb.barrier_wait()
    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == ["train/loss", "train/parts/a"]
    assert scalars["train/loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert scalars["train/parts/a"] == [(0, 0.0), (1, 2.0), (2, 4.0)]


def test_a_series_without_a_step_is_counted_per_series(tmp_path):
    sink = TensorBoardSink(tmp_path)
    tap = jax.jit(lambda x: tap_to([sink], x, name="eval"))
    for x in (5.0, 7.0):
        tap(x)
    hcb.barrier_wait()
    assert read_scalars(tmp_path) == {"eval": [(0, 5.0), (1, 7.0)]}


def test_arrays_asked_for_become_histograms_and_others_their_mean(tmp_path):
    sink = TensorBoardSink(tmp_path, histograms=["train/grads/*"])
    grads = {"w": jnp.arange(100.0), "b": jnp.ones(3)}
    jax.jit(lambda g: tap_to([sink], {"step": 4, "grads": g, "act": jnp.arange(4.0)},
                             name="train"))(grads)
    hcb.barrier_wait()
    histograms = {}
    for path in event_files(tmp_path):
        for event in read_events(path):
            for value in event.summary.value:
                if value.HasField("histo"):
                    histograms[value.tag] = (event.step, value.histo)
    assert sorted(histograms) == ["train/grads/b", "train/grads/w"]
    step, histo = histograms["train/grads/w"]
    assert step == 4 and histo.num == 100 and histo.min == 0.0 and histo.max == 99.0
    assert histo.sum == pytest.approx(4950.0)
    assert read_scalars(tmp_path) == {"train/act": [(4, 1.5)]}


def test_events_are_on_disk_after_barrier_wait(tmp_path):
    sink = TensorBoardSink(tmp_path)
    jax.jit(lambda: tap_to([sink], {"step": 1, "loss": 0.25}, name="train"))()
    hcb.barrier_wait()
    assert read_scalars(tmp_path) == {"train/loss": [(1, 0.25)]}


def test_events_are_written_at_exit(tmp_path):
    result = run_python(f"""
        import jax
        from hostcallback.consumer import TensorBoardSink, tap_to
        sink = TensorBoardSink({str(tmp_path)!r})
        jax.jit(lambda: tap_to([sink], {{"step": 2, "loss": 0.5}}, name="train"))()
    """)
    assert result.returncode == 0, result.stderr
    assert read_scalars(tmp_path) == {"train/loss": [(2, 0.5)]}


def test_each_process_writes_its_own_event_file_in_the_shared_directory(tmp_path):
    sinks = [TensorBoardSink(tmp_path) for _ in range(2)]
    for process, sink in enumerate(sinks):
        sink.emit(TapRecord(name="shard", step=0, process=process,
                            value={"loss": np.float32(process)}))
        sink.close()
    names = [os.path.basename(p) for p in event_files(tmp_path)]
    assert len(names) == 2
    assert sorted(n.split(".")[-3] for n in names) == ["p0", "p1"]
    assert sorted(v for _, v in read_scalars(tmp_path)["shard/loss"]) == [0.0, 1.0]


def test_a_closed_sink_refuses_records_clearly(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.close()
    with pytest.raises(ValueError, match="is closed"):
        sink.emit(TapRecord(name="x", value=1.0))


def test_without_tensorboardx_the_sink_names_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"pip install 'hostcallback\[tensorboard\]'"):
        TensorBoardSink(tmp_path)


def test_per_device_writes_a_run_per_device_of_a_pmap(tmp_path):
    sink = TensorBoardSink(tmp_path, per_device=True)
    devices = jax.local_devices()[:4]
    step = jax.pmap(lambda s, x: tap_to([sink], {"step": s, "loss": x}, name="train"))
    step(jnp.zeros(len(devices), jnp.int32), jnp.arange(len(devices), dtype=jnp.float32))
    hcb.barrier_wait()
    runs = {f"dev{d.id}": read_scalars(tmp_path / f"dev{d.id}") for d in devices}
    assert runs == {f"dev{d.id}": {"train/loss": [(0, float(i))]}
                    for i, d in enumerate(devices)}


def test_non_finite_values_are_left_out_of_a_histogram_and_counted(tmp_path, caplog):
    sink = TensorBoardSink(tmp_path, histograms=["train/w"])
    values = np.array([1.0, np.nan, 2.0, np.inf, -np.inf, 3.0])
    with caplog.at_level("WARNING", logger="hostcallback.tensorboard"):
        sink.emit(TapRecord(name="train", step=7, value={"w": values}))
    sink.close()
    (histo,) = [value.histo for path in event_files(tmp_path) for event in read_events(path)
                for value in event.summary.value if value.HasField("histo")]
    assert histo.num == 3 and histo.min == 1.0 and histo.max == 3.0
    assert "3 non-finite values" in caplog.text
