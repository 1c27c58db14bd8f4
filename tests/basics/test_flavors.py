"""Callback flavors, pure_callback, and the keyword names tutorials use."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from hostcallback import CallbackFlavor


def _counting(calls):
    def host(v):
        calls.append(np.asarray(v).copy())
        return np.asarray(v)
    return host


def test_an_unused_pure_call_may_be_dropped(transport):
    calls = []

    def f(x):
        hcb.call(_counting(calls), x, result_shape=x, callback_flavor=CallbackFlavor.PURE)
        return x + 1

    jax.jit(f)(jnp.float32(1))
    hcb.barrier_wait()
    assert calls == []


def test_an_unused_io_callback_call_is_never_dropped(transport):
    calls = []

    def f(x):
        hcb.call(_counting(calls), x, result_shape=x)  # IO_CALLBACK is the default
        return x + 1

    jax.jit(f)(jnp.float32(1))
    hcb.barrier_wait()
    assert len(calls) == 1


def test_a_used_pure_call_runs(transport):
    calls = []
    f = jax.jit(lambda x: hcb.call(_counting(calls), x, result_shape=x,
                                   callback_flavor="PURE") * 2)
    assert f(jnp.float32(3)) == 6
    assert len(calls) == 1


@pytest.mark.needs_internals("PURE taps")
def test_an_unused_pure_tap_inside_a_branch_is_dropped_with_it(transport, collector):
    def f(x):
        jax.lax.cond(x > 0, lambda: hcb.id_tap(collector, x, callback_flavor=CallbackFlavor.PURE),
                     lambda: x)
        hcb.id_tap(collector, x + 10)  # an IO_CALLBACK tap next to it still fires
        return x

    jax.jit(f)(jnp.float32(1))
    hcb.barrier_wait()
    assert [float(v) for v in collector.values] == [11.0]


@pytest.mark.parametrize("tap", [
    lambda x: hcb.id_tap(lambda a, t: None, x, result=x * 2, callback_flavor="pure"),
    lambda x: hcb.id_print(x, result=x * 2, callback_flavor="pure"),
    lambda x: hcb.id_print("x={x}", x=x, callback_flavor="pure"),
], ids=["id_tap result=", "id_print result=", "id_print format string"])
def test_a_pure_tap_whose_outputs_are_never_used_is_refused_not_silently_dropped(tap):
    with pytest.raises(ValueError, match="callback_flavor=PURE would never run"):
        jax.jit(tap)(jnp.float32(1))


def test_a_debug_call_cannot_return_a_result():
    with pytest.raises(ValueError, match="DEBUG cannot return a result"):
        hcb.call(lambda v: v, 1.0, result_shape=1.0, callback_flavor=CallbackFlavor.DEBUG)


def test_a_debug_call_runs_without_the_device_waiting_for_it(transport):
    release, done = threading.Event(), []

    def slow_host(v):
        release.wait(30)
        done.append(float(v))

    f = jax.jit(lambda x: (hcb.call(slow_host, x, callback_flavor=CallbackFlavor.DEBUG), x + 1)[1])
    with hcb.config.override(delivery="async"):  # the default waits at the end for it
        assert float(f(jnp.float32(2))) == 3.0  # returned while the host function still waits
    assert done == []
    release.set()
    hcb.barrier_wait()
    assert done == [2.0]


def test_an_unknown_flavor_is_a_value_error():
    with pytest.raises(ValueError, match="callback_flavor must be one of"):
        hcb.id_tap(lambda a, t: None, 1.0, callback_flavor="fast")


def test_the_legacy_xla_only_flavor_is_the_io_callback_flavor():
    assert CallbackFlavor.XLA_ONLY is CallbackFlavor.IO_CALLBACK


def test_pure_callback_passes_positional_and_keyword_arguments(transport):
    def host(x, y, *, scale):
        return np.asarray(x * y * scale, np.float32)

    out_type = jax.ShapeDtypeStruct((3,), jnp.float32)
    f = jax.jit(lambda x, y: hcb.pure_callback(host, out_type, x, y, scale=jnp.float32(2)))
    np.testing.assert_array_equal(f(jnp.arange(3.0), jnp.float32(3)), [0.0, 6.0, 12.0])


def test_pure_callback_runs_per_device_under_shard_map(transport):
    mesh = jax.make_mesh((4,), ("i",))
    shards = []

    def host(x):
        shards.append(np.asarray(x).copy())
        return np.asarray(x) * 2

    f = jax.jit(jax.shard_map(
        lambda x: hcb.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x),
        mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, P("i")))
    np.testing.assert_array_equal(f(x), np.arange(8.0) * 2)
    assert sorted(s.tolist() for s in shards) == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


def test_a_failing_pure_callback_names_itself_once_where_it_failed(transport):
    def broken(x):
        raise ArithmeticError("no")

    f = jax.jit(lambda x: hcb.pure_callback(broken, jax.ShapeDtypeStruct((), jnp.float32), x))
    with pytest.raises(Exception, match="broken failed: ArithmeticError: no"):
        jax.block_until_ready(f(jnp.float32(1)))
    hcb.barrier_wait()  # reported once, where it failed


def test_pure_callback_refuses_a_sharding_over_several_devices():
    mesh = jax.make_mesh((4,), ("i",))
    with pytest.raises(NotImplementedError, match="device_index"):
        hcb.pure_callback(lambda x: x, jax.ShapeDtypeStruct((), jnp.float32), 1.0,
                          sharding=jax.sharding.NamedSharding(mesh, P()))


def test_result_shape_dtypes_is_a_synonym_of_result_shape(transport):
    f = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) + 1, x, result_shape_dtypes=x))
    assert f(jnp.float32(1)) == 2.0


def test_result_shape_and_result_shape_dtypes_together_are_an_error():
    with pytest.raises(TypeError, match="both result_shape and result_shape_dtypes"):
        hcb.call(lambda v: v, 1.0, result_shape=1.0, result_shape_dtypes=1.0)


def test_tap_with_transform_true_is_accepted(transport, collector):
    jax.jit(lambda x: hcb.id_tap(collector, x, tap_with_transform=True))(jnp.float32(5))
    hcb.barrier_wait()
    assert collector.values == [5.0]


def test_id_print_accepts_tap_with_transform_and_does_not_print_it(transport, capsys):
    jax.jit(lambda x: hcb.id_print(x, what="loss", tap_with_transform=True))(jnp.float32(5))
    hcb.barrier_wait()
    printed = capsys.readouterr().out
    assert "what: loss" in printed and "tap_with_transform" not in printed


def test_tap_with_transform_false_is_refused_clearly():
    with pytest.raises(TypeError, match="always called as tap_func"):
        hcb.id_tap(lambda a, t: None, 1.0, tap_with_transform=False)
