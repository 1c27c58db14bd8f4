"""id_tap: what the tap function receives, what id_tap returns, and the errors it gives."""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb


def test_tap_function_receives_the_value_and_empty_transforms(transport, collector):
    jax.jit(lambda x: hcb.id_tap(collector, x * 2))(jnp.arange(3.0))
    hcb.barrier_wait()
    (arg, transforms, _), = collector.calls
    np.testing.assert_array_equal(arg, [0.0, 2.0, 4.0])
    assert transforms == ()


def test_id_tap_returns_its_argument(transport, collector):
    out = jax.jit(lambda x: hcb.id_tap(collector, x) + 1)(jnp.float32(1))
    assert out == 2


def test_id_tap_returns_result_when_given(transport, collector):
    out = jax.jit(lambda x: hcb.id_tap(collector, x, result=x * 10))(jnp.float32(2))
    assert out == 20


def test_pytrees_arrive_with_their_structure(transport, collector):
    value = {"a": jnp.ones(2), "b": (jnp.int32(3), [jnp.zeros((1, 2))])}
    jax.jit(lambda v: hcb.id_tap(collector, v))(value)
    hcb.barrier_wait()
    (arg, _, _), = collector.calls
    assert set(arg) == {"a", "b"}
    assert arg["b"][0] == 3 and arg["b"][1][0].shape == (1, 2)


def test_tap_with_device_passes_the_device(transport, collector):
    jax.jit(lambda x: hcb.id_tap(collector, x, tap_with_device=True))(jnp.float32(1))
    hcb.barrier_wait()
    (_, _, device), = collector.calls
    assert device == jax.devices()[0]


def test_taps_outside_jit_work(transport, collector):
    hcb.id_tap(collector, jnp.arange(2))
    hcb.barrier_wait()
    np.testing.assert_array_equal(collector.values[0], [0, 1])


@pytest.mark.parametrize("dtype", [
    np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.float16,
    ml_dtypes.bfloat16, np.float32, np.complex64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_every_supported_dtype_arrives_exactly(transport, collector, dtype):
    value = (np.arange(6) % 3).astype(dtype).reshape(2, 3)
    jax.jit(lambda v: hcb.id_tap(collector, v))(value)
    hcb.barrier_wait()
    got = collector.values[0]
    assert got.dtype == np.dtype(dtype) and got.shape == (2, 3)
    np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8))


def test_zero_size_and_scalar_leaves_arrive(transport, collector):
    jax.jit(lambda a, b: hcb.id_tap(collector, (a, b)))(jnp.zeros((0, 3)), jnp.float32(7))
    hcb.barrier_wait()
    (empty, scalar), = collector.values
    assert empty.shape == (0, 3) and scalar.shape == () and scalar == 7


def test_an_empty_pytree_still_calls_the_tap(transport, collector):
    jax.jit(lambda x: (hcb.id_tap(collector, ()), x)[1])(1.0)
    hcb.barrier_wait()
    assert collector.values == [()]


def test_payloads_are_aligned_read_only_views(transport, collector):
    jax.jit(lambda x: hcb.id_tap(collector, x))(jnp.ones((4, 4)))
    hcb.barrier_wait()
    got = collector.values[0]
    assert got.ctypes.data % 64 == 0
    assert not got.flags.writeable


def test_a_tap_of_many_leaves_arrives_whole(transport, collector):
    # More arrays than the native handler keeps on its stack (16): the rest go to the heap.
    leaves = [jnp.full((i % 3 + 1,), i, jnp.int32) for i in range(40)]
    jax.jit(lambda v: hcb.id_tap(collector, v))(leaves)
    hcb.barrier_wait()
    (arg, _, _), = collector.calls
    assert len(arg) == 40
    for i, leaf in enumerate(arg):
        np.testing.assert_array_equal(leaf, np.full((i % 3 + 1,), i, np.int32))


def test_hundred_independent_taps_arrive_in_program_order(transport, collector):
    def f(x):
        for i in range(100):
            hcb.id_tap(collector, x + i)
        return x

    jax.jit(f)(jnp.int32(0))
    hcb.barrier_wait()
    assert [int(v) for v in collector.values] == list(range(100))


def _tap_in_every_kind_of_place(collector, ordered):
    def tag(name):
        def tap(arg, transforms):
            collector((name, int(arg)), transforms)
        return tap

    def f(x):
        hcb.id_tap(tag("before"), x, ordered=ordered)
        lax.fori_loop(0, 2, lambda i, c: hcb.id_tap(tag("fori"), c + i, ordered=ordered), x)
        lax.scan(lambda c, a: (c, hcb.id_tap(tag("scan"), a, ordered=ordered)), x, jnp.arange(2))

        def cond_fun(c):
            hcb.id_tap(tag("while_cond"), c, ordered=ordered)
            return c < 2

        lax.while_loop(cond_fun, lambda c: hcb.id_tap(tag("while_body"), c + 1, ordered=ordered), x)
        lax.cond(x == 0, lambda: (hcb.id_tap(tag("cond_true"), x, ordered=ordered), None)[1],
                 lambda: (hcb.id_tap(tag("cond_false"), x, ordered=ordered), None)[1])
        hcb.id_tap(tag("after"), x, ordered=ordered)
        return x

    jax.jit(f)(jnp.int32(0))
    hcb.barrier_wait()
    return collector.values


PROGRAM_ORDER = [
    ("before", 0), ("fori", 0), ("fori", 1), ("scan", 0), ("scan", 1),
    ("while_cond", 0), ("while_body", 1), ("while_cond", 1), ("while_body", 2),
    ("while_cond", 2), ("cond_true", 0), ("after", 0)]


def test_unused_taps_in_loops_and_branches_all_run(transport, collector):
    """Every tap runs, in the portable mode too (where their order is not kept)."""
    assert sorted(_tap_in_every_kind_of_place(collector, ordered=False)) == sorted(PROGRAM_ORDER)


@pytest.mark.needs_internals("program order inside a computation")
def test_unused_taps_in_loops_and_branches_all_run_in_program_order(transport, collector):
    assert _tap_in_every_kind_of_place(collector, ordered=False) == PROGRAM_ORDER


@pytest.mark.needs_internals("ordered=True")
def test_ordered_taps_keep_program_order_across_loops_and_branches(transport, collector):
    assert _tap_in_every_kind_of_place(collector, ordered=True) == PROGRAM_ORDER


@pytest.mark.needs_internals("ordered=True")
def test_ordered_taps_follow_the_configured_default(transport, collector):
    with hcb.config.override(ordered=True):
        jaxpr = jax.make_jaxpr(lambda x: hcb.id_tap(collector, x))(1.0)
    assert "HostcallbackOrderedTap" in str(jaxpr.effects)
    default = jax.make_jaxpr(lambda x: hcb.id_tap(collector, x))(1.0).effects
    assert "HostcallbackOrderedTap" not in str(default)


def test_taps_in_nested_jit_run(transport, collector):
    inner = jax.jit(lambda x: hcb.id_tap(collector, x + 1))
    jax.jit(lambda x: (inner(x), x)[1])(jnp.int32(1))
    hcb.barrier_wait()
    assert collector.values == [2]


def test_retracing_the_same_function_compiles_once(transport, collector):
    traces = []

    def f(x):
        traces.append(1)
        return hcb.id_tap(collector, x)

    jitted = jax.jit(f)
    jitted(jnp.float32(1))
    jitted(jnp.float32(2))
    assert len(traces) == 1
    jax.clear_caches()  # the jaxpr is rebuilt; the consumer id must come out the same
    lowered_a = jax.jit(f).lower(jnp.float32(1)).as_text()
    lowered_b = jax.jit(f).lower(jnp.float32(1)).as_text()
    assert lowered_a == lowered_b


def test_keyword_arguments_are_refused_with_a_hint():
    with pytest.raises(TypeError, match="functools.partial"):
        hcb.id_tap(lambda a, t: None, 1.0, what="loss")


def test_a_tap_func_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match="callable"):
        hcb.id_tap("print", 1.0)


@pytest.mark.parametrize("leaf", ["text", object()])
def test_non_array_leaves_are_refused_naming_the_leaf(leaf):
    with pytest.raises(TypeError, match=r"\['bad'\]"):
        hcb.id_tap(lambda a, t: None, {"bad": leaf, "good": 1.0})


def test_unsupported_dtypes_are_refused_naming_the_supported_ones():
    with pytest.raises(TypeError, match="int4 cannot be tapped; supported dtypes are"):
        jax.jit(lambda x: hcb.id_tap(lambda a, t: None, x))(jnp.zeros(4, dtype=jnp.int4))


def test_an_array_of_more_dimensions_than_numpy_allows_is_refused_at_trace_time():
    with pytest.raises(ValueError, match=r"\['x'\] has 65 dimensions; a tapped array can have "
                                         r"at most 64"):
        jax.jit(lambda x: hcb.id_tap(lambda a, t: None, {"x": x}))(jnp.zeros((1,) * 65))


def test_prng_key_arrays_arrive_as_key_arrays(transport, collector):
    key = jax.random.key(42)
    out = jax.jit(lambda k: hcb.id_tap(collector, {"key": k, "x": 1.0}))(key)
    hcb.barrier_wait()
    (value,) = collector.values
    assert jax.dtypes.issubdtype(value["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(value["key"]), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(key))


def test_none_leaves_are_part_of_the_structure(transport, collector):
    jax.jit(lambda x: hcb.id_tap(collector, (x, None)))(jnp.float32(3))
    hcb.barrier_wait()
    assert collector.values[0][1] is None and collector.values[0][0] == 3


def test_high_rank_values_arrive_with_their_shape(transport, collector):
    shape = (1, 2) * 16  # rank 32
    value = np.arange(2 ** 16, dtype=np.float32).reshape(shape)
    jax.jit(lambda x: hcb.id_tap(collector, x))(value)
    hcb.barrier_wait()
    np.testing.assert_array_equal(collector.values[0], value)


def test_a_bad_device_index_is_refused():
    with pytest.raises(ValueError, match="device_index must be a non-negative int"):
        hcb.id_tap(lambda a, t: None, 1.0, device_index=-1)
