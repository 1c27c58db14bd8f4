"""call: host code whose results come back into the computation, and every way it can go wrong."""

import logging
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import run_python
from hostcallback._native import outfeed
from hostcallback._records import handover


def test_call_returns_the_host_result_into_the_computation(transport):
    f = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) * 2, x, result_shape=x) + 1)
    np.testing.assert_array_equal(f(jnp.arange(3.0)), [1.0, 3.0, 5.0])


def test_call_results_can_be_pytrees_of_other_shapes(transport):
    def host(v):
        v = np.asarray(v)
        return {"sum": v.sum(), "twice": (v * 2).astype(np.int32)}

    shape = {"sum": jax.ShapeDtypeStruct((), jnp.float32),
             "twice": jax.ShapeDtypeStruct((3,), jnp.int32)}
    out = jax.jit(lambda x: hcb.call(host, x, result_shape=shape))(jnp.arange(3.0))
    assert out["sum"] == 3.0 and out["twice"].dtype == jnp.int32
    np.testing.assert_array_equal(out["twice"], [0, 2, 4])


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint16, np.int32, np.uint32, np.float16,
                                   ml_dtypes.bfloat16, np.float32, np.complex64])
def test_every_dtype_round_trips_through_call(transport, dtype):
    value = (np.arange(6) % 3).astype(dtype).reshape(2, 3)
    out = jax.jit(lambda v: hcb.call(lambda a: np.asarray(a).copy(), v, result_shape=v))(value)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), value.view(np.uint8))


def test_float64_round_trips_with_x64(transport):
    with jax.enable_x64(True):
        value = np.array([1.0 / 3.0, 2.5e300])
        out = jax.jit(lambda v: hcb.call(lambda a: np.asarray(a) * 2, v, result_shape=v))(value)
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, value * 2)


def test_zero_size_results_and_empty_pytrees(transport):
    out = jax.jit(lambda x: hcb.call(lambda v: (np.zeros((0, 2), np.float32), ()), x,
                                     result_shape=(jax.ShapeDtypeStruct((0, 2), jnp.float32), ())))(
        1.0)
    assert out[0].shape == (0, 2) and out[1] == ()
    assert jax.jit(lambda x: hcb.call(lambda v: None, x, result_shape=()))(1.0) == ()


def test_a_call_without_result_runs_and_returns_none(transport, collector):
    assert hcb.call(lambda v: collector(v, ()), jnp.float32(4)) is None
    hcb.barrier_wait()
    assert collector.values == [4.0]


def test_scalar_result_shapes_and_python_number_results(transport):
    out = jax.jit(lambda x: hcb.call(lambda v: 2.5, x, result_shape=np.float32(0)))(1.0)
    assert out == 2.5 and out.dtype == jnp.float32


def test_calls_in_loops_and_branches(transport):
    def body(i, c):
        return hcb.call(lambda v: np.asarray(v) + 1, c, result_shape=c)

    f = jax.jit(lambda x: lax.cond(x > 0, lambda y: lax.fori_loop(0, 5, body, y), lambda y: y, x))
    assert f(jnp.float32(1)) == 6 and f(jnp.float32(-1)) == -1


@pytest.mark.needs_internals("the device of callback-transport records", transport="callback")
def test_pmap_calls_on_each_device_with_its_slice_and_device(transport):
    f = jax.pmap(lambda x: hcb.call(lambda v, device: np.asarray(v) * 10 + device.id, x,
                                    result_shape=x, call_with_device=True))
    np.testing.assert_array_equal(f(jnp.arange(4.0)), [0.0, 11.0, 22.0, 33.0])


def test_shard_map_calls_on_each_device_with_its_shard(transport):
    mesh = jax.make_mesh((4,), ("i",))
    f = jax.jit(jax.shard_map(lambda x: hcb.call(lambda v: np.asarray(v)[::-1].copy(), x,
                                                 result_shape=x),
                              mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    out = f(jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i"))))
    np.testing.assert_array_equal(out, [1, 0, 3, 2, 5, 4, 7, 6])


def test_a_raising_callback_fails_the_computation_clearly_and_the_process_goes_on(transport):
    def broken(v):
        raise ValueError("no answer today")

    with pytest.raises(Exception, match="call consumer broken failed: ValueError: no answer today"):
        jax.jit(lambda x: hcb.call(broken, x, result_shape=x))(1.0).block_until_ready()
    hcb.barrier_wait()  # reported once, where it failed: not again at the barrier
    ok = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) + 1, x, result_shape=x))(1.0)
    assert ok == 2.0  # later calls keep working


@pytest.mark.needs_internals("the count of tapped computations running on a device")
def test_a_call_failing_after_a_long_loop_leaves_no_computation_running(caplog):
    """XLA runs what follows a long loop on one of its worker threads, not the one that began the
    computation: the failing call ends its computation all the same (XLA's execution names it),
    so the next barrier neither waits for it nor takes it for failed, saying so, seconds later."""
    def broken(v):
        raise ValueError("no answer today")

    heavy = jnp.ones((800, 800)) / 800  # products XLA splits over its threads
    step = jax.jit(lambda c: hcb.call(broken, lax.fori_loop(
        0, 10, lambda i, c: jnp.tanh(c @ c), c)[0, 0], result_shape=c[0, 0]))
    device = jax.devices()[0]
    for _ in range(3):
        with pytest.raises(Exception, match="no answer today"):
            step(heavy).block_until_ready()
        assert outfeed.computations(device.id)["running"] == 0
    with caplog.at_level(logging.WARNING, logger="hostcallback"):
        hcb.barrier_wait(timeout=60)
    assert "taken for failed" not in caplog.text


@pytest.mark.parametrize("answer,message", [
    (lambda v: np.zeros(2, np.float32), (r"returned float32\[2\] for result leaf 0; its "
                                         r"result_shape says float32\[3\]")),
    (lambda v: np.zeros(3, np.int32), (r"returned int32\[3\] for result leaf 0; its "
                                       r"result_shape says float32\[3\]")),
    (lambda v: (np.zeros(3, np.float32),) * 2, "returned a value of structure"),
])
def test_a_wrong_answer_is_a_clear_error_naming_the_mismatch(transport, answer, message):
    with pytest.raises(Exception, match=message):
        jax.jit(lambda x: hcb.call(answer, x, result_shape=x))(jnp.zeros(3)).block_until_ready()
    hcb.barrier_wait()  # the computation's error was the report


def test_a_list_answers_a_declared_tuple_as_jax_pure_callback_accepts(transport):
    shapes = (jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    answer = lambda v: [np.asarray(v) + 1, np.int32(7)]  # noqa: E731 - a list, not a tuple
    out = jax.jit(lambda x: hcb.call(answer, x, result_shape=shapes))(jnp.zeros(3))
    np.testing.assert_array_equal(out[0], np.ones(3, np.float32))
    assert int(out[1]) == 7
    pure = jax.jit(lambda x: hcb.pure_callback(lambda v: [v + 1, np.int32(7)], shapes, x))
    assert int(pure(jnp.zeros(3))[1]) == 7


def test_a_call_that_takes_too_long_fails_after_its_timeout(transport):
    def slow(v):
        time.sleep(1.5)
        return v

    # Compile first: the clock measures the wait for the answer, not XLA's compiler.
    compiled = jax.jit(
        lambda x: hcb.call(slow, x, result_shape=x, timeout=0.2)).lower(1.0).compile()
    started = time.monotonic()
    with pytest.raises(Exception, match="did not answer this call within its timeout"):
        compiled(1.0).block_until_ready()
    assert time.monotonic() - started < 1.4
    hcb.barrier_wait()  # the late answer is dropped, the receiver goes on
    assert jax.jit(lambda x: hcb.call(lambda v: v, x, result_shape=x))(3.0) == 3.0


@pytest.mark.parametrize("result_shape,message", [
    ("float32", r"result_shape is of type str"),
    ({"a": object()}, r"result_shape\['a'\] is of type object"),
    (jax.ShapeDtypeStruct((2,), jnp.int4), "int4 cannot be tapped"),
])
def test_a_bad_result_shape_is_a_value_error_at_trace_time(result_shape, message):
    with pytest.raises(ValueError, match=message):
        hcb.call(lambda v: v, 1.0, result_shape=result_shape)


@pytest.mark.needs_internals("hostcallback's own message for grad of a call (JAX's is given)")
def test_grad_through_call_points_to_custom_vjp():
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.grad(lambda x: hcb.call(lambda v: v, x, result_shape=x))(1.0)


@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
def test_a_call_in_a_sharded_jit_runs_once_on_the_device_at_device_index(transport):
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    calls = []

    def host(v, device):
        calls.append((np.asarray(v).copy(), device))
        return np.asarray(v) * 2

    f = jax.jit(lambda x: hcb.call(host, x, result_shape=x, call_with_device=True,
                                   device_index=2) + 1)
    out = f(x)
    np.testing.assert_array_equal(out, np.arange(8.0) * 2 + 1)
    assert len(calls) == 1
    np.testing.assert_array_equal(calls[0][0], np.arange(8.0))  # the whole logical value
    assert calls[0][1] == mesh.devices.flat[2]


@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
def test_a_sharded_jit_call_hands_every_device_the_exact_bits(transport):
    mesh = jax.make_mesh((4,), ("i",))
    answers = (np.array([-0.0, np.nan, 1.5], np.float32), np.array([True, False]),
               np.array([1 + 2j, -0.0 - 3j], np.complex64), np.array([-7, 127], np.int8),
               np.array([2**31 + 5], np.uint32), np.array([0.1], ml_dtypes.bfloat16))
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in answers)
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("i")))
    outs = jax.jit(lambda x: hcb.call(lambda v: answers, x, result_shape=shapes))(x)
    for out, answer in zip(outs, answers):
        for shard in out.addressable_shards:  # every device holds the caller's bits
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8),
                                          answer.view(np.uint8))


SHARDED_CALL_TIMING_OUT = """
import time
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import hostcallback as hcb

mesh = jax.make_mesh((4,), ("i",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))

def slow(v):
    time.sleep(1.0)
    return v

compiled = jax.jit(lambda x: hcb.call(slow, x, result_shape=x, timeout=0.2)).lower(x).compile()
try:
    compiled(x).block_until_ready()
except Exception as error:
    print("failed:", "did not answer this call within its timeout of 0.2 s" in str(error))
hcb.barrier_wait()  # the late answer is dropped, the receiver goes on
"""


@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
def test_a_sharded_jit_call_that_times_out_fails_every_device_and_says_so_at_once(transport):
    # In a process of its own: JAX keeps the failed computation's runtime token, and every
    # later jax.effects_barrier() of the process would raise its error again.
    result = run_python(SHARDED_CALL_TIMING_OUT, env={"HOSTCALLBACK_TRANSPORT": transport},
                        timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "failed: True"
    # Said on stderr when it happened, in case XLA ends the process before the error is read.
    assert "did not answer this call within its timeout of 0.2 s" in result.stderr
    assert "every device fails with this error" in result.stderr


@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
def test_device_index_out_of_range_is_a_clear_error(transport):
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    with pytest.raises(ValueError, match="device_index=4 is out of range .* 4 device"):
        jax.jit(lambda x: hcb.call(lambda v: v, x, result_shape=x, device_index=4))(x)
    with pytest.raises(ValueError, match="device_index=1 is out of range .* 1 device"):
        jax.jit(lambda x: hcb.id_tap(lambda *a: None, x, device_index=1))(jnp.ones(2))


def test_taps_and_calls_share_the_per_device_order(transport, collector):
    def f(x):
        hcb.id_tap(collector, x)
        y = hcb.call(lambda v: (collector(np.asarray(v) + 100, ()), np.asarray(v) + 1)[1], x,
                     result_shape=x)
        hcb.id_tap(collector, y)
        return y

    jax.jit(f)(jnp.int32(0))
    hcb.barrier_wait()
    assert [int(v) for v in collector.values] == [0, 100, 1]


def test_a_custom_vjp_whose_backward_pass_is_another_call(transport):
    @jax.custom_vjp
    def host_square(x):
        return hcb.call(lambda v: np.asarray(v) ** 2, x, result_shape=x)

    def forward(x):
        return host_square(x), x

    def backward(x, cotangent):
        return (hcb.call(lambda args: 2 * np.asarray(args[0]) * np.asarray(args[1]),
                         (x, cotangent), result_shape=x),)

    host_square.defvjp(forward, backward)
    value, grad = jax.jit(jax.value_and_grad(lambda x: host_square(x).sum()))(jnp.arange(3.0))
    assert value == 5.0
    np.testing.assert_array_equal(grad, [0.0, 2.0, 4.0])


def test_a_call_function_may_run_jax_on_another_device(transport):
    other = jax.devices()[1]
    triple = jax.jit(lambda v: v * 3)

    def host(v):
        return np.asarray(triple(jax.device_put(np.asarray(v), other)))

    x = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    out = jax.jit(lambda x: hcb.call(host, x, result_shape=x))(x)
    np.testing.assert_array_equal(out, [0.0, 3.0, 6.0])


def test_a_shape_tuple_as_result_shape_warns_at_trace_time_saying_what_to_write():
    with pytest.warns(UserWarning, match=r"describes a tuple of 1 integer scalar\(s\), not an "
                                         r"array of shape \(2,\); for an array write "
                                         r"result_shape=jax.ShapeDtypeStruct\(\(2,\), dtype\)"
                      ) as caught:
        jax.jit(lambda x: hcb.call(lambda v: (np.int32(7),), x, result_shape=(2,))).lower(1.0)
    assert caught[0].filename == __file__  # points at the user's line


def test_a_tuple_of_int_scalars_as_result_shape_still_means_what_legacy_meant(transport):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = jax.jit(lambda x: hcb.call(lambda v: (np.int32(7),), x, result_shape=(2,)))(1.0)
    assert isinstance(out, tuple) and int(out[0]) == 7


def test_a_call_without_result_shape_whose_function_returns_something_warns_once(transport):
    host = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) * 2, x))
    with pytest.warns(UserWarning, match="has no result_shape, so what the function returned "
                                         "\\(float32\\) is dropped"), hcb.taps_delivered():
        assert host(jnp.float32(1)) is None
    with warnings.catch_warnings(record=True) as again, hcb.taps_delivered():
        warnings.simplefilter("always")
        host(jnp.float32(2))
    assert [str(w.message) for w in again] == []


def test_a_call_whose_caller_gave_up_before_it_ran_is_not_run_and_the_log_says_why(transport,
                                                                                   caplog):
    held, release, ran = threading.Event(), threading.Event(), []
    hold = jax.jit(lambda x: hcb.id_tap(lambda v, _: held.set() or release.wait(10), x))
    call = jax.jit(lambda x: hcb.call(lambda v: ran.append(v) or v, x, result_shape=x,
                                      timeout=0.2))
    with hcb.config.override(delivery="async"):  # the call is not to wait for hold's end
        held_result = hold(1.0)
    assert held.wait(10)  # the receiver now waits in this tap, ahead of the call's record
    with pytest.raises(Exception, match="did not answer this call within its timeout"):
        call(2.0).block_until_ready()
    with caplog.at_level(logging.WARNING, logger="hostcallback"):
        release.set()
        hcb.barrier_wait()
    held_result.block_until_ready()
    assert ran == []
    assert [r.levelname for r in caplog.records if r.name == "hostcallback"] == ["WARNING"]
    assert "was not run: its caller stopped waiting" in caplog.text
    assert handover._answers == {} and handover._arguments == {}
