"""hostcallback.io_callback and pure_callback against JAX's own, on the same input: results,
calls received, and the exceptions JAX raises where they cannot go (grad, vmap)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback as jax_io_callback

import hostcallback as hcb

SCALAR = jax.ShapeDtypeStruct((), jnp.float32)
X = jnp.arange(3.0, dtype=jnp.float32)
IO_CALLBACKS = {"jax": jax_io_callback, "ours": hcb.io_callback}
PURE_CALLBACKS = {"jax": jax.pure_callback, "ours": hcb.pure_callback}


def forget_earlier_failures():
    """jax.effects_barrier() raises, once, the error of an earlier test's failed computation."""
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError:
        pass


def on_both(run):
    """``run(io_callback, calls)`` with JAX's and ours: (JAX's result, its calls), (ours...)."""
    out = []
    forget_earlier_failures()
    for name in ("jax", "ours"):
        calls = []
        result = run(IO_CALLBACKS[name], calls)
        jax.effects_barrier()
        hcb.barrier_wait()
        out.append((jax.tree.map(np.asarray, result), calls))
    return out


def assert_same(run):
    (theirs, their_calls), (ours, our_calls) = on_both(run)
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    assert our_calls == their_calls and our_calls


def test_io_callback_returns_its_results_into_the_computation(transport):
    def host(x, *, scale):
        return {"sum": np.float32(np.sum(x) * scale), "twice": np.asarray(x) * 2}

    def run(io_callback, calls):
        shapes = {"sum": SCALAR, "twice": jax.ShapeDtypeStruct((3,), jnp.float32)}
        def f(x):
            calls.append("traced")
            return io_callback(host, shapes, x, scale=3.0)
        return jax.jit(f)(X)

    assert_same(run)


@pytest.mark.needs_internals("ordered=True")
def test_io_callback_ordered_keeps_program_order_across_computations(transport):
    def run(io_callback, calls):
        step = jax.jit(lambda x: io_callback(lambda v: calls.append(float(v)) or v, SCALAR, x,
                                             ordered=True))
        return [step(jnp.float32(i)) for i in range(6)]

    assert_same(run)


def test_io_callback_under_vmap_runs_once_per_element(transport):
    def run(io_callback, calls):
        def host(v, w):
            calls.append((float(v), float(w)))
            return np.float32(v * w)
        return jax.vmap(lambda v: io_callback(host, SCALAR, v, jnp.float32(2.0)))(X)

    assert_same(run)


@pytest.mark.parametrize("api", ["io_callback", "pure_callback"])
def test_outside_jit_the_callback_gets_jax_arrays(transport, api):
    kinds = {}
    for name in ("jax", "ours"):
        callback = (IO_CALLBACKS if api == "io_callback" else PURE_CALLBACKS)[name]
        got = []
        callback(lambda v: got.append(v) or v, SCALAR, jnp.float32(1.5))  # noqa: B023 - run now
        hcb.barrier_wait()
        kinds[name] = (isinstance(got[0], jax.Array), float(got[0]))
    assert kinds["ours"] == kinds["jax"] == (True, 1.5)


@pytest.mark.needs_internals("JAX's errors under grad and vmap")
def test_pure_callback_and_io_callback_of_one_function_keep_their_own_rules(transport):
    def host(v):
        return v

    jax.jit(lambda x: hcb.pure_callback(host, SCALAR, x))(1.0)  # registered first
    with pytest.raises(ValueError, match="IO callbacks do not support JVP"):
        jax.grad(lambda x: hcb.io_callback(host, SCALAR, x))(1.0)


def test_inside_jit_arguments_that_are_not_traced_still_arrive_as_numpy(transport):
    got = []
    jax.jit(lambda: hcb.io_callback(lambda v: got.append(v) or v, SCALAR, np.float32(2.0)))()
    hcb.barrier_wait()
    assert isinstance(got[0], np.ndarray) and float(got[0]) == 2.0


ERRORS = [
    ("io_callback under grad",
     lambda cb: jax.grad(lambda x: cb(lambda v: v, SCALAR, x))(1.0), IO_CALLBACKS),
    ("ordered io_callback under vmap",
     lambda cb: jax.vmap(lambda x: cb(lambda v: v, SCALAR, x, ordered=True))(X), IO_CALLBACKS),
    ("pure_callback under grad",
     lambda cb: jax.grad(lambda x: cb(lambda v: v, SCALAR, x))(1.0), PURE_CALLBACKS),
    ("pure_callback under vmap without vmap_method",
     lambda cb: jax.vmap(lambda x: cb(lambda v: v, SCALAR, x))(X), PURE_CALLBACKS),
    ("io_callback transposed",
     lambda cb: jax.linear_transpose(lambda x: cb(lambda v: v, SCALAR, x), 1.0)(1.0),
     IO_CALLBACKS),
    ("pure_callback transposed",
     lambda cb: jax.linear_transpose(lambda x: cb(lambda v: v, SCALAR, x), 1.0)(1.0),
     PURE_CALLBACKS),
]


@pytest.mark.needs_internals("JAX's errors under grad and vmap")
@pytest.mark.parametrize("case,run,callbacks", ERRORS, ids=[case for case, _, _ in ERRORS])
def test_where_jax_refuses_we_raise_its_exception_with_its_message(case, run, callbacks):
    raised = {}
    for name, callback in callbacks.items():
        with pytest.raises(Exception) as error:
            run(callback)
        raised[name] = (type(error.value), str(error.value).split("\n")[0])
    assert raised["ours"] == raised["jax"]


def test_a_sharding_over_several_devices_is_refused_clearly():
    mesh = jax.make_mesh((4,), ("i",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with pytest.raises(NotImplementedError, match="only None or a single-device sharding"):
        hcb.io_callback(lambda v: v, SCALAR, 1.0, sharding=sharding)
