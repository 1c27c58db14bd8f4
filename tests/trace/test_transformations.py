"""Taps under vmap, autodiff, custom rules and remat: one test per row of
docs/transformations.md."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb


def checkpoint_needs_internals(**params):
    """The portable mode's native taps inside jax.checkpoint need JAX 0.12 or later (JAX allows
    the FFI effect there only from 0.12): marks a test for older JAX only."""
    if jax.__version_info__ >= (0, 12):
        return lambda test: test
    return pytest.mark.needs_internals("taps inside jax.checkpoint on JAX < 0.12", **params)


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_vmap_taps_the_whole_batch_once_with_its_batch_dims(transport, collector):
    jax.vmap(lambda x, y: hcb.id_tap(collector, (x, y)), in_axes=(0, None))(
        jnp.arange(6.0).reshape(3, 2), jnp.float32(7))
    hcb.barrier_wait()
    ((x, y), transforms, _), = collector.calls
    assert x.shape == (3, 2) and y == 7
    assert transforms == (("batch", {"batch_dims": (0, None)}),)


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_nested_vmap_adds_one_batch_entry_per_level(transport, collector):
    jax.vmap(jax.vmap(lambda x: hcb.id_tap(collector, x)))(jnp.ones((2, 3)))
    hcb.barrier_wait()
    (_, transforms, _), = collector.calls
    assert [name for name, _ in transforms] == ["batch", "batch"]


def test_grad_fires_the_tap_once_with_primal_values(transport, collector):
    grad = jax.jit(jax.grad(lambda x: jnp.sum(hcb.id_tap(collector, x) ** 2)))(jnp.arange(3.0))
    hcb.barrier_wait()
    np.testing.assert_array_equal(grad, [0.0, 2.0, 4.0])
    assert len(collector.calls) == 1
    np.testing.assert_array_equal(collector.values[0], [0.0, 1.0, 2.0])


@checkpoint_needs_internals(transport="native")
def test_remat_under_grad_fires_the_tap_again_when_the_forward_is_recomputed(transport,
                                                                             collector):
    def f(x):
        return jnp.sum(hcb.id_tap(collector, jnp.sin(x)) ** 2)

    jax.jit(jax.grad(jax.checkpoint(f)))(1.0)
    hcb.barrier_wait()
    assert len(collector.calls) == 2  # the forward pass, then its recomputation
    assert all(transforms == () for _, transforms, _ in collector.calls)
    np.testing.assert_allclose([float(v) for v in collector.values], [np.sin(1.0)] * 2,
                               rtol=1e-6)


def test_grad_of_grad_still_fires_the_tap_once(transport, collector):
    jax.jit(jax.grad(jax.grad(lambda x: hcb.id_tap(collector, x) ** 3)))(2.0)
    hcb.barrier_wait()
    assert [float(v) for v in collector.values] == [2.0]


def test_jvp_and_vjp_fire_once_with_primal_values(transport, collector):
    jax.jvp(lambda x: hcb.id_tap(collector, x) * 2, (3.0,), (1.0,))
    _, pullback = jax.vjp(lambda x: hcb.id_tap(collector, x) * 2, 4.0)
    pullback(1.0)
    hcb.barrier_wait()
    assert [float(v) for v in collector.values] == [3.0, 4.0]
    assert all(transforms == () for _, transforms, _ in collector.calls)


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_vmap_of_a_while_loop_taps_every_lane_each_iteration(transport, collector):
    def count_down(n):
        return lax.while_loop(lambda n: n > 0, lambda n: hcb.id_tap(collector, n) - 1, n)

    jax.jit(jax.vmap(count_down))(jnp.array([1, 2]))
    hcb.barrier_wait()
    assert [v.tolist() for v in collector.values] == [[1, 2], [0, 1]]  # a done lane is tapped too
    assert collector.calls[0][1] == (("batch", {"batch_dims": (0,)}),)


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_vmap_of_a_while_predicate_taps_every_lane(transport, collector):
    def count_down(n):
        return lax.while_loop(lambda n: hcb.id_tap(collector, n) > 0, lambda n: n - 1, n)

    jax.jit(jax.vmap(count_down))(jnp.array([1, 2]))
    hcb.barrier_wait()
    # JAX's batched while evaluates the predicate again inside the body, so each state is
    # tapped twice except the last: one tap of both lanes each time.
    states = [v.tolist() for v in collector.values]
    assert sorted(set(map(tuple, states))) == [(0, 0), (0, 1), (1, 2)]
    assert states[0] == [1, 2] and states[-1] == [0, 0]


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)",
                             transport="callback")
@pytest.mark.needs_internals("taps inside loops under grad, before JAX 0.12", transport="native")
def test_scan_and_cond_under_grad_and_vmap_keep_tapping(transport, collector):
    def f(x):
        def body(carry, _):
            carry = lax.cond(carry > 0, lambda c: hcb.id_tap(collector, c), lambda c: c, carry)
            return carry * 2, None
        return lax.scan(body, x, None, length=2)[0]

    jax.jit(jax.grad(f))(1.0)
    jax.jit(jax.vmap(f))(jnp.array([1.0, 3.0]))
    hcb.barrier_wait()
    assert [np.asarray(v).tolist() for v in collector.values] == [1.0, 2.0, [1.0, 3.0],
                                                                   [2.0, 6.0]]


def _sin_with_tapped_tangent(tap):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(hcb.id_tap(tap, x))

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), hcb.id_tap(tap, jnp.cos(x) * t)  # a tap on tangent values

    return f


def test_a_tap_on_tangents_fires_in_jvp_with_the_tangent(transport, collector):
    f = _sin_with_tapped_tangent(collector)
    jax.jvp(f, (0.0,), (3.0,))
    hcb.barrier_wait()
    assert [(float(v), t) for v, t, _ in collector.calls] == [(0.0, ()), (3.0, ())]


@pytest.mark.needs_internals("taps of tangents or cotangents")
def test_a_transposed_tap_on_tangents_fires_in_the_backward_pass_with_cotangents(transport,
                                                                                  collector):
    f = _sin_with_tapped_tangent(collector)
    grad = jax.jit(jax.grad(lambda x: 5.0 * f(x)))(0.0)
    hcb.barrier_wait()
    assert grad == 5.0
    (primal, primal_transforms, _), (cotangent, transforms, _) = collector.calls
    assert float(primal) == 0.0 and primal_transforms == ()
    assert float(cotangent) == 5.0 and transforms == (("transpose", {}),)


def test_taps_in_custom_jvp_primal_functions_fire_normally(transport, collector):
    f = _sin_with_tapped_tangent(collector)
    jax.jit(f)(1.0)
    hcb.barrier_wait()
    assert [float(v) for v in collector.values] == [1.0]


def test_taps_in_custom_vjp_rules_fire_when_the_rule_runs(transport, collector):
    @jax.custom_vjp
    def f(x):
        return x * 2

    f.defvjp(lambda x: (hcb.id_tap(collector, x) * 2, None),
             lambda _, g: (hcb.id_tap(collector, g * 2),))
    jax.jit(f)(1.0)  # no differentiation: neither rule runs
    hcb.barrier_wait()
    assert collector.values == []
    jax.jit(jax.grad(f))(3.0)
    hcb.barrier_wait()
    assert [float(v) for v in collector.values] == [3.0, 2.0]


@pytest.mark.needs_internals('replays="mark"', replays="mark")
@pytest.mark.needs_internals('replays="skip"', replays="skip")
@checkpoint_needs_internals(transport="native", replays="deliver")
@pytest.mark.parametrize("replays, expected", [
    ("deliver", [(), ()]),
    ("mark", [(), (("remat_replay", {}),)]),
    ("skip", [()]),
])
def test_replays_under_remat_can_be_marked_or_skipped(transport, collector, replays, expected):
    def f(x):
        return jnp.sum(hcb.id_tap(collector, jnp.sin(x), replays=replays) ** 2)

    grad = jax.jit(jax.grad(jax.checkpoint(f)))(1.0)
    hcb.barrier_wait()
    np.testing.assert_allclose(grad, 2 * np.sin(1.0) * np.cos(1.0), rtol=1e-6)
    assert [transforms for _, transforms, _ in collector.calls] == expected


@checkpoint_needs_internals(transport="native")
def test_a_saved_tap_is_not_replayed(transport, collector):
    def f(x):
        return jnp.sum(hcb.id_tap(collector, jnp.sin(x)) ** 2)

    policy = jax.checkpoint_policies.everything_saveable
    jax.jit(jax.grad(jax.checkpoint(f, policy=policy)))(1.0)
    hcb.barrier_wait()
    assert len(collector.calls) == 1


def test_an_unknown_replays_value_is_a_value_error():
    with pytest.raises(ValueError, match="replays must be one of"):
        hcb.id_tap(lambda a, t: None, 1.0, replays="sometimes")


def test_tracing_the_same_function_twice_compiles_once(transport, collector):
    def f(x):
        return hcb.id_tap(collector, x) + 1

    first, second = jax.jit(f), jax.jit(f)
    assert first.lower(1.0).as_text() == second.lower(1.0).as_text()
    jitted = jax.jit(f)
    jitted(1.0)
    jitted(2.0)
    assert jitted._cache_size() == 1
