"""vmap of call and pure_callback: each vmap_method means what it means for jax.pure_callback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb


def _recording_add(seen):
    def add(args):
        x, y = (np.asarray(a) for a in args)
        seen.append((x.shape, y.shape))
        return x + y
    return add


def _vmapped_add(vmap_method, seen, x, y):
    def f(x, y):
        shape = jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y))
        out = jax.ShapeDtypeStruct(shape, jnp.result_type(x, y))
        return hcb.call(_recording_add(seen), (x, y), result_shape=out, vmap_method=vmap_method)
    return jax.jit(jax.vmap(f, in_axes=(0, None)))(x, y)


@pytest.mark.parametrize("vmap_method, expected_shapes", [
    ("expand_dims", [((4,), (1,))]),
    ("broadcast_all", [((4,), (4,))]),
    ("legacy_vectorized", [((4,), ())]),
    ("sequential", [((), ())] * 4),
    ("sequential_unrolled", [((), ())] * 4),
])
@pytest.mark.needs_internals("vmap methods of calls other than sequential")
def test_each_vmap_method_gives_the_host_the_shapes_of_the_reference(transport, vmap_method,
                                                                     expected_shapes):
    seen = []
    out = _vmapped_add(vmap_method, seen, jnp.arange(4.0), jnp.float32(1.0))
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0, 4.0])
    assert seen == expected_shapes


def test_vmap_of_call_without_a_vmap_method_lists_the_choices():
    with pytest.raises(NotImplementedError, match="sequential.*expand_dims.*broadcast_all"):
        jax.vmap(lambda x: hcb.call(lambda v: v, x, result_shape=x))(jnp.ones(3))


def test_an_unknown_vmap_method_is_a_value_error():
    with pytest.raises(ValueError, match="vmap_method must be one of"):
        hcb.call(lambda v: v, 1.0, result_shape=1.0, vmap_method="parallel")


def test_sequential_calls_the_host_once_per_element_in_order(transport):
    seen = []

    def host(v):
        seen.append(int(v))
        return np.asarray(v) * 10

    f = jax.vmap(lambda x: hcb.call(host, x, result_shape=x, vmap_method="sequential"))
    np.testing.assert_array_equal(jax.jit(f)(jnp.arange(5)), np.arange(5) * 10)
    assert seen == [0, 1, 2, 3, 4]


@pytest.mark.needs_internals("vmap methods of calls other than sequential")
def test_the_batch_axis_moves_to_the_front_for_the_host(transport):
    seen = []

    def host(v):
        seen.append(np.asarray(v).shape)
        return np.asarray(v).sum(axis=1)

    def f(x):  # x is one column of a (2, 3) matrix: the batch is axis 1 of the input
        return hcb.call(host, x, result_shape=jax.ShapeDtypeStruct((), x.dtype),
                        vmap_method="expand_dims")

    out = jax.vmap(f, in_axes=1)(jnp.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(out, [3.0, 5.0, 7.0])
    assert seen == [(3, 2)]


@pytest.mark.parametrize("vmap_method", ["expand_dims", "sequential"])
@pytest.mark.needs_internals("vmap methods of calls other than sequential")
def test_nested_vmap_of_call(transport, vmap_method):
    f = lambda x: hcb.call(lambda v: np.asarray(v) + 1, x, result_shape=x,
                           vmap_method=vmap_method)
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jax.jit(jax.vmap(jax.vmap(f)))(x), x + 1)


@pytest.mark.needs_internals("vmap methods of calls other than sequential")
def test_a_host_that_ignores_the_batch_gets_a_clear_error(transport):
    f = jax.vmap(lambda x: hcb.call(lambda v: np.float32(0), x,
                                    result_shape=jax.ShapeDtypeStruct((), jnp.float32),
                                    vmap_method="expand_dims"))
    with pytest.raises(Exception, match=r"float32\[\] for result leaf 0; its result_shape says "
                                        r"float32\[3\]"):
        jax.block_until_ready(jax.jit(f)(jnp.ones(3)))
    hcb.barrier_wait()  # the computation's error was the report


@pytest.mark.needs_internals("vmap methods of calls other than sequential")
def test_pure_callback_under_vmap_matches_jax_pure_callback(transport):
    def fun(x, y, *, vmap_method, implementation):
        out = jax.ShapeDtypeStruct(jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y)),
                                   jnp.result_type(x, y))
        return implementation(lambda a, b: np.asarray(a + b, out.dtype), out, x, y,
                              vmap_method=vmap_method)

    for vmap_method in ("expand_dims", "broadcast_all", "sequential"):
        ours, theirs = (jax.vmap(functools.partial(fun, vmap_method=vmap_method,
                                                   implementation=impl), in_axes=(0, None))(
            jnp.arange(4.0), 1.0) for impl in (hcb.pure_callback, jax.pure_callback))
        np.testing.assert_array_equal(ours, theirs)
