"""Every API on a CUDA GPU, on both transports: taps, prints, calls, barriers, stop and exit,
hostcallback.debug and io_callback; program order, large taps, backpressure, consumer errors,
and a tap's value while the stream runs on and overwrites its buffer (conftest.py says how these
run and where they are skipped)."""

import io
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PLATFORM

import hostcallback as hcb
from helpers import run_python
from hostcallback import config
from hostcallback._native import outfeed

ON_GPU = PLATFORM != "cpu"


STEP_SIZE = 4096 if ON_GPU else 256  # a step of tens of milliseconds, on either


def slow_step(gpu, seen, rounds=40):
    """A compiled step the device works at for tens of milliseconds that taps its result's sum
    into ``seen``, and its input; the step has run once, its tap handled and forgotten."""

    def step(x):
        for _ in range(rounds):
            x = jnp.tanh(x @ x / STEP_SIZE)
        return hcb.id_tap(lambda v, _: seen.append(float(v)), jnp.sum(x))

    step = jax.jit(step)
    x = jax.device_put(jnp.eye(STEP_SIZE, dtype=jnp.float32), gpu)
    step(x).block_until_ready()
    hcb.barrier_wait()
    seen.clear()
    return step, x


def test_id_tap_delivers_the_values(transport, gpu):
    seen = []
    f = jax.jit(lambda x: hcb.id_tap(lambda v, _: seen.append(np.array(v)), x * 2))
    f(jax.device_put(np.arange(5, dtype=np.float32), gpu)).block_until_ready()
    hcb.barrier_wait()
    np.testing.assert_array_equal(seen[0], np.arange(5, dtype=np.float32) * 2)


@pytest.mark.skipif(not ON_GPU, reason="the GPU tap handler runs only on a GPU")
def test_native_taps_take_the_gpu_handler_and_its_pinned_buffers(transport, gpu):
    before = outfeed.pinned_stats()
    seen = []
    f = jax.jit(lambda x: hcb.id_tap(lambda v, _: seen.append(1), x))
    for _ in range(3):
        f(jax.device_put(np.ones(1000, np.float32), gpu))
    hcb.barrier_wait()
    after = outfeed.pinned_stats()
    used = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
    assert seen == [1, 1, 1]
    assert used >= (3 if transport == "native" else 0)
    assert (used == 0) == (transport == "callback")
    assert after["pageable_fallbacks"] == before["pageable_fallbacks"]


def test_id_print_prints(transport, gpu):
    out = io.StringIO()
    f = jax.jit(lambda x: hcb.id_print(x + 1, what="x", output_stream=out))
    f(jax.device_put(np.array([1, 2], np.int32), gpu))
    hcb.barrier_wait()
    assert "what: x" in out.getvalue() and "[2 3]" in out.getvalue()


def test_call_returns_the_hosts_answer(transport, gpu):
    f = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) * 3, x,
                                   result_shape=jax.ShapeDtypeStruct((4,), np.float32)) + 1)
    out = f(jax.device_put(np.arange(4, dtype=np.float32), gpu))
    np.testing.assert_array_equal(np.asarray(out), np.arange(4) * 3 + 1)


def test_results_are_ready_only_once_their_taps_were_handled(transport, gpu):
    seen = []
    step, x = slow_step(gpu, seen)
    for _ in range(3):
        step(x).block_until_ready()
        assert len(seen) == 1, "block_until_ready returned before the step's tap was handled"
        seen.clear()


def fences_released():
    """Computations whose end stopped waiting for a consumer stuck past its patience."""
    return sum(s["fences_released"] for s in hcb.queue_stats().values())


def test_async_delivery_makes_results_ready_before_the_taps(transport, gpu):
    release = threading.Event()

    def held(v, _):
        release.wait(60)

    before = fences_released()
    with config.override(delivery="async"):
        step = jax.jit(lambda x: hcb.id_tap(held, x + 1))
        ready = step(jax.device_put(np.ones(4, np.float32), gpu))
        # A fenced step would wait for the held consumer until its patience let it go (counted).
        ready.block_until_ready()
    release.set()
    hcb.barrier_wait()
    assert fences_released() == before


def moves_gpu_arrays(gpu, fetched):
    """A consumer that fetches an array from the GPU and sends one there and back."""
    held = jax.device_put(np.arange(8, dtype=np.float32), gpu).block_until_ready()

    def consumer(v, _):
        fetched.append(np.asarray(jax.device_get(held)))
        fetched.append(np.asarray(jax.device_get(jax.device_put(np.asarray(v) * 3, gpu))))

    return consumer


def assert_moved(fetched):
    np.testing.assert_array_equal(fetched[0], np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(fetched[1], np.full(4, 6, np.float32))


def test_a_consumer_moves_gpu_arrays_while_its_async_step_runs_on(transport, gpu):
    fetched = []
    consumer = moves_gpu_arrays(gpu, fetched)
    before = fences_released()
    with config.override(delivery="async"):
        step = jax.jit(lambda x: hcb.id_tap(consumer, x + 1))
        step(jax.device_put(np.ones(4, np.float32), gpu)).block_until_ready()
    hcb.barrier_wait()
    assert_moved(fetched)
    assert fences_released() == before


@pytest.mark.skipif(not ON_GPU, reason="only a GPU's transfers wait for its stream")
def test_a_consumer_that_moves_gpu_arrays_holds_its_fenced_step_for_its_patience(transport, gpu):
    # The step's end waits (on the stream) for this consumer, whose transfers wait for the
    # stream: the consumer's patience (5 s) ends the wait, counted as fences_released, and the
    # consumer's transfers then finish (docs/architecture.md, "On a GPU").
    fetched = []
    consumer = moves_gpu_arrays(gpu, fetched)
    before = fences_released()
    step = jax.jit(lambda x: hcb.id_tap(consumer, x + 1))
    step(jax.device_put(np.ones(4, np.float32), gpu)).block_until_ready()
    hcb.barrier_wait()
    assert_moved(fetched)
    assert fences_released() == before + 1


def test_a_barrier_covers_a_step_still_running(transport, gpu):
    seen = []
    step, x = slow_step(gpu, seen)
    for _ in range(3):
        step(x)  # dispatched, not waited for
    hcb.barrier_wait()
    assert len(seen) == 3


def test_a_barrier_from_another_thread_covers_a_step_still_running(transport, gpu):
    seen = []
    step, x = slow_step(gpu, seen)
    step(x)
    waiter = threading.Thread(target=hcb.barrier_wait)
    waiter.start()
    waiter.join(timeout=120)
    assert not waiter.is_alive() and len(seen) == 1


def test_taps_delivered_covers_its_block(transport, gpu):
    seen = []
    step, x = slow_step(gpu, seen)
    with hcb.taps_delivered():
        step(x)
    assert len(seen) == 1


def test_program_order_over_ten_thousand_taps(transport, gpu):
    seen = []

    def body(carry, i):
        hcb.id_tap(lambda v, _: seen.append(int(v)), i)
        return carry + i, None

    f = jax.jit(lambda xs: jax.lax.scan(body, 0, xs)[0])
    f(jax.device_put(np.arange(10_000, dtype=np.int32), gpu))
    hcb.barrier_wait()
    assert seen == list(range(10_000))


@pytest.mark.parametrize("mib", [4, 64])
def test_large_taps_arrive_whole(transport, gpu, mib):
    seen = []
    n = mib * (1 << 20) // 4
    f = jax.jit(lambda x: hcb.id_tap(lambda v, _: seen.append(np.array(v)), x + 1))
    x = jax.device_put(np.arange(n, dtype=np.float32), gpu)
    f(x)
    hcb.barrier_wait()
    np.testing.assert_array_equal(seen[0], np.arange(n, dtype=np.float32) + 1)


def test_a_tap_sees_the_value_of_its_point_while_the_stream_overwrites_it(transport, gpu):
    seen = []

    def body(i, x):
        hcb.id_tap(lambda v, _: seen.append(np.array(v)), x)
        return x + 1  # XLA reuses the carry's buffer: the next iteration overwrites it

    f = jax.jit(lambda x: jax.lax.fori_loop(0, 200, body, x))
    f(jax.device_put(np.zeros(1 << 16, np.float32), gpu))
    hcb.barrier_wait()
    expected = 0.0
    for value in seen:
        assert np.all(value == np.float32(expected))
        expected += 1
    assert len(seen) == 200


def test_backpressure_with_a_slow_consumer_loses_nothing_and_stays_bounded(transport, gpu):
    budget = 1 << 20
    seen = []

    def slow(v, _):
        time.sleep(0.002)
        seen.append(int(v[0]))

    def body(carry, i):
        hcb.id_tap(slow, jnp.full(64 << 10, i, dtype=jnp.int32))  # 256 KiB a tap
        return carry, None

    f = jax.jit(lambda xs: jax.lax.scan(body, 0, xs)[0])
    with config.override(max_queue_bytes=budget):
        hcb.reset_peak_bytes_queued()
        f(jax.device_put(np.arange(200, dtype=np.int32), gpu))
        hcb.barrier_wait()
        stats = hcb.queue_stats()
        pinned_in_use = outfeed.pinned_stats()["in_use_bytes"]
    assert seen == list(range(200))
    record = (64 << 10) * 4 + 4096
    # peak_bytes_queued counts the room GPU taps reserved too
    assert all(s["peak_bytes_queued"] <= budget + record for s in stats.values())
    assert pinned_in_use <= budget + record  # what the queue holds; the consumer keeps nothing


def test_a_consumer_error_surfaces_at_the_barrier(transport, gpu):
    def fails(v, _):
        raise ValueError("consumer failed")

    jax.jit(lambda x: hcb.id_tap(fails, x))(jax.device_put(np.ones(3), gpu))
    with pytest.raises(hcb.CallbackException) as raised:
        hcb.barrier_wait()
    assert isinstance(raised.value.__cause__, ValueError)


def test_debug_callback_and_print(transport, gpu, capfd):
    seen = []

    def f(x):
        hcb.debug.callback(lambda v: seen.append(np.array(v)), x)
        hcb.debug.print("x is {}", x)
        return x + 1

    jax.jit(f)(jax.device_put(np.array([7.0], np.float32), gpu))
    hcb.debug.effects_barrier()
    np.testing.assert_array_equal(seen[0], [7.0])
    assert "x is [7.]" in capfd.readouterr().out


def test_io_callback(transport, gpu):
    f = jax.jit(lambda x: hcb.io_callback(lambda v: np.asarray(v) + 5,
                                          jax.ShapeDtypeStruct((2,), np.float32), x))
    np.testing.assert_array_equal(np.asarray(f(jax.device_put(np.ones(2, np.float32), gpu))),
                                  [6.0, 6.0])


_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import hostcallback as hcb
hcb.configure(transport={transport!r})
gpu = jax.devices({platform!r})[0]
def step(x):
    for _ in range(40):
        x = jnp.tanh(x @ x / {size})
    return hcb.id_tap(lambda v, _: print("tapped", flush=True), jnp.sum(x))
step = jax.jit(step)
x = jax.device_put(jnp.eye({size}, dtype=jnp.float32), gpu)
for _ in range(5):
    step(x)
{ending}
"""


@pytest.mark.parametrize("ending", ["", "hcb.stop_outfeed_receiver()"], ids=["exit", "stop"])
def test_taps_in_flight_are_delivered_at_exit_and_stop(transport, ending):
    script = _SCRIPT.format(transport=transport, platform=PLATFORM, ending=ending,
                           size=STEP_SIZE)
    env = {"JAX_PLATFORMS": "" if ON_GPU else "cpu", "XLA_FLAGS": ""}
    done = run_python(script, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("tapped") == 5, done.stderr[-3000:]
