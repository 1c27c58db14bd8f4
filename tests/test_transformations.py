"""Taps under vmap and autodiff (the basics; more in the transformations issue)."""

import jax
import jax.numpy as jnp
import numpy as np

import hostcallback as hcb


def test_vmap_taps_the_whole_batch_once_with_its_batch_dims(transport, collector):
    jax.vmap(lambda x, y: hcb.id_tap(collector, (x, y)), in_axes=(0, None))(
        jnp.arange(6.0).reshape(3, 2), jnp.float32(7))
    hcb.barrier_wait()
    ((x, y), transforms, _), = collector.calls
    assert x.shape == (3, 2) and y == 7
    assert transforms == (("batch", {"batch_dims": (0, None)}),)


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
