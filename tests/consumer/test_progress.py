"""Progress bars: ProgressSink on a terminal and in a log, and progress for scan/fori_loop."""

import io
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from helpers import run_python
from hostcallback.consumer import (
    ProgressSink,
    Sink,
    loop_progress,
    progress_fori_loop,
    progress_scan,
    scan_progress,
    tap_to,
)


class ListSink(Sink):
    def __init__(self):
        self.records = []

    def emit(self, record):
        self.records.append(record)

    @property
    def steps(self):
        return [r.step for r in self.records]


def body(i, x):
    return x * 0.5 + i


def scan_body(carry, x):
    i, value = x
    carry = carry + value * i
    return carry, carry * 2


def test_progress_sink_writes_plain_lines_with_values_when_not_a_terminal():
    out = io.StringIO()
    sink = ProgressSink(total=5, desc="train", file=out)
    step = jax.jit(lambda s: tap_to([sink], {"step": s, "loss": 1.0 / (s + 1)}, name="train"))
    for s in range(5):
        step(s)
    hcb.barrier_wait()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("train: 1/5 steps (20%)")
    assert lines[-1].startswith("train: 5/5 steps (100%)") and lines[-1].endswith("done")
    assert "loss=0.2" in lines[-1]


def test_progress_sink_draws_a_tqdm_bar_with_the_latest_values_in_its_postfix():
    out = io.StringIO()
    sink = ProgressSink(total=4, desc="fit", file=out, bar=True)
    step = jax.jit(lambda s: tap_to([sink], {"step": s, "loss": s * 1.5}, name="fit"))
    for s in range(4):
        step(s)
    hcb.barrier_wait()
    final = out.getvalue().split("\r")[-1]
    assert final.startswith("fit: 100%") and "4/4" in final and "loss=4.5" in final


def test_progress_sink_prints_a_line_at_most_every_line_seconds():
    out = io.StringIO()
    sink = ProgressSink(total=100, file=out, line_seconds=3600)
    for s in range(100):
        sink.emit(_record(s))
    assert len(out.getvalue().splitlines()) == 2  # the first step and the end


def test_progress_sink_without_steps_counts_records():
    out = io.StringIO()
    sink = ProgressSink(file=out, line_seconds=3600)
    for _ in range(7):
        sink.emit(_record(None))
    sink.close()
    assert sink.position == 7
    assert out.getvalue().splitlines()[-1].startswith("progress: 7 steps")


def test_a_loop_that_runs_again_starts_a_new_bar():
    sink = ProgressSink(total=3, file=io.StringIO())
    for _ in range(2):
        for s in range(3):
            sink.emit(_record(s))
    assert sink.bars_started == 2 and sink.position == 3


def test_a_bar_on_a_terminal_without_tqdm_is_refused_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match=r"pip install 'hostcallback\[progress\]'"):
        ProgressSink(bar=True)


def test_loop_progress_reports_every_n_steps_and_the_last_and_keeps_the_result():
    sink = ListSink()
    decorated = loop_progress(10, every=4, sink=sink)(body)
    got = jax.jit(lambda x: lax.fori_loop(0, 10, decorated, x))(1.0)
    hcb.barrier_wait()
    assert float(got) == float(lax.fori_loop(0, 10, body, 1.0))
    assert sink.steps == [3, 7, 9]


def test_loop_progress_shows_metrics_from_the_carry():
    sink = ListSink()
    decorated = loop_progress(4, every=2, sink=sink, metrics=lambda x: {"x": x})(body)
    jax.jit(lambda x: lax.fori_loop(0, 4, decorated, x))(0.0)
    hcb.barrier_wait()
    assert [float(r.value["x"]) for r in sink.records] == [1.0, 4.25]


def test_scan_progress_reports_steps_of_a_scan_over_arange_and_keeps_the_results():
    sink = ListSink()
    xs = (jnp.arange(9), jnp.linspace(0.0, 1.0, 9))
    decorated = scan_progress(9, every=3, sink=sink)(scan_body)
    carry, ys = jax.jit(lambda c: lax.scan(decorated, c, xs))(0.0)
    hcb.barrier_wait()
    want_carry, want_ys = lax.scan(scan_body, 0.0, xs)
    np.testing.assert_allclose(ys, want_ys)
    assert float(carry) == pytest.approx(float(want_carry))
    assert sink.steps == [2, 5, 8]


def test_a_decorated_loop_drives_a_bar_to_its_end():
    out = io.StringIO()
    decorated = loop_progress(1000, desc="loop", file=out)(body)
    jax.jit(lambda x: lax.fori_loop(0, 1000, decorated, x))(0.0)
    hcb.barrier_wait()
    assert decorated.progress_sink.position == 1000
    assert out.getvalue().splitlines()[-1].startswith("loop: 1000/1000 steps (100%)")


@pytest.mark.parametrize("lower,upper,every", [(0, 12, 4), (3, 17, 5), (0, 3, 10)])
def test_progress_fori_loop_gives_fori_loops_result_and_reports_each_chunk(lower, upper, every):
    sink = ListSink()
    got = jax.jit(lambda x: progress_fori_loop(lower, upper, body, x, every=every,
                                               sink=sink))(1.0)
    hcb.barrier_wait()
    assert float(got) == pytest.approx(float(lax.fori_loop(lower, upper, body, 1.0)))
    n = upper - lower
    assert sink.steps == sorted({*range(every - 1, n, every), n - 1})


@pytest.mark.parametrize("n,every", [(12, 4), (14, 5), (3, 10)])
def test_progress_scan_gives_scans_results_and_reports_each_chunk(n, every):
    sink = ListSink()
    xs = (jnp.arange(n), jnp.linspace(0.0, 1.0, n))
    carry, ys = jax.jit(lambda c: progress_scan(scan_body, c, xs, every=every, sink=sink))(0.0)
    hcb.barrier_wait()
    want_carry, want_ys = lax.scan(scan_body, 0.0, xs)
    np.testing.assert_allclose(ys, want_ys, rtol=1e-6)
    assert float(carry) == pytest.approx(float(want_carry))
    assert sink.steps == sorted({*range(every - 1, n, every), n - 1})


def test_progress_scan_without_xs_uses_length():
    sink = ListSink()
    carry, ys = progress_scan(lambda c, _: (c + 1, c), 0, length=6, every=2, sink=sink)
    hcb.barrier_wait()
    assert int(carry) == 6 and list(np.asarray(ys)) == [0, 1, 2, 3, 4, 5]
    assert sink.steps == [1, 3, 5]


def test_a_loop_length_that_is_not_a_python_int_is_refused_clearly():
    with pytest.raises(ValueError, match="must be a Python int >= 1"):
        loop_progress(0)
    with pytest.raises(ValueError, match=r"every=0 must be an int >= 1"):
        scan_progress(10, every=0)


def test_a_lagging_device_neither_restarts_nor_reopens_the_bar():
    sink = ProgressSink(total=3, file=io.StringIO())
    for step in range(3):
        sink.emit(_record(step, device_id=0))
    sink.emit(_record(1, device_id=1))  # behind device 0, then the end of the first run
    sink.emit(_record(2, device_id=1))
    sink.emit(_record(0, device_id=0))  # device 0 runs the loop again
    sink.emit(_record(2, device_id=1))  # device 1 still on the first run: ignored
    sink.emit(_record(0, device_id=1))
    assert sink.bars_started == 2 and sink.position == 1


def test_a_pmap_loop_run_twice_gives_two_bars(tmp_path):
    out = io.StringIO()
    sink = ProgressSink(total=20, desc="pmap", file=out)
    step = jax.pmap(lambda s: tap_to([sink], {"step": s}, name="pmap"))
    for _ in range(2):
        for s in range(20):
            step(jnp.full(jax.local_device_count(), s, jnp.int32))
        assert sink.wait(timeout=60)
    hcb.barrier_wait()
    assert sink.bars_started == 2
    assert [line.endswith("done") for line in out.getvalue().splitlines()] == [False, True] * 2


def _record(step, device_id=-1):
    from hostcallback.consumer import TapRecord

    return TapRecord(name="x", step=step, device_id=device_id, value={"loss": np.float32(0.5)})


def test_wait_returns_once_the_loops_bar_has_finished():
    sink = ProgressSink(total=100, file=io.StringIO())
    loop = jax.jit(lambda x: progress_fori_loop(0, 100, body, x, every=10, sink=sink))
    for _ in range(2):
        loop(1.0)
        assert sink.wait(timeout=60)
        assert sink.position == 100
    assert not sink.wait(timeout=0.01)  # each finished bar ends one wait


def test_a_rerun_whose_only_report_equals_the_last_starts_a_new_bar():
    sink = ProgressSink(total=10, file=io.StringIO())
    for _ in range(2):  # progress_fori_loop(0, 10, every=10) run twice: one report of step 9
        sink.emit(_record(9))
        assert sink.wait(timeout=10)
    assert sink.bars_started == 2


def test_a_slower_device_finishing_the_same_run_does_not_start_a_bar():
    sink = ProgressSink(total=10, file=io.StringIO())
    sink.emit(_record(9, device_id=0))
    sink.emit(_record(9, device_id=1))
    assert sink.bars_started == 1


class SlowProgressSink(ProgressSink):
    """Takes 50 ms per record: without the loop waiting for its bar, the results are ready long
    before the bar is."""

    def emit(self, record):
        time.sleep(0.05)
        super().emit(record)


@pytest.mark.parametrize("loop", ["fori_loop", "scan"])
def test_the_bar_is_drawn_before_the_loops_results_are_ready(transport, loop):
    out = io.StringIO()
    sink = SlowProgressSink(total=100, desc="train", file=out)
    if loop == "fori_loop":
        run = jax.jit(lambda x: progress_fori_loop(0, 100, body, x, every=10, sink=sink))
    else:
        run = jax.jit(lambda c: progress_scan(lambda c, x: (c + x, c), c, jnp.arange(100.0),
                                              every=10, sink=sink)[0])
    jax.block_until_ready(run(1.0))  # no barrier_wait
    assert out.getvalue().splitlines()[-1].endswith("done"), out.getvalue()
    assert sink.position == 100


def test_the_chunked_loops_run_with_64_bit_types_enabled():
    result = run_python("""
        import io
        import jax, jax.numpy as jnp
        from hostcallback.consumer import ProgressSink, progress_fori_loop, progress_scan
        sink = ProgressSink(total=100, file=io.StringIO())
        x = jax.jit(lambda x: progress_fori_loop(0, 100, lambda i, x: x + i, x, every=30,
                                                 sink=sink))(jnp.float64(0))
        c, _ = jax.jit(lambda c: progress_scan(lambda c, v: (c + v, v), c, jnp.arange(100.0),
                                               every=30, sink=ProgressSink(total=100,
                                               file=io.StringIO())))(jnp.float64(0))
        print(float(x), float(c), sink.position)
        """, devices=1, env={"JAX_ENABLE_X64": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["4950.0", "4950.0", "100"]
