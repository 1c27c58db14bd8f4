"""hcb.taps_delivered(): a block whose taps have been handled when it ends, so that what a
consumer warns reaches pytest.warns around it (ikpls's pattern) and its errors are raised there."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import hostcallback as hcb


def warn_if_negative(value, transforms):
    if float(value) < 0:
        warnings.warn("a negative value was tapped", UserWarning, stacklevel=2)


@jax.jit
def step(x):  # a library's jitted step, unchanged by the test
    hcb.id_tap(warn_if_negative, x.sum())
    return x * 2


@pytest.mark.parametrize("run", range(5))
def test_a_warning_from_a_tap_reaches_pytest_warns_around_the_block(transport, run):
    with pytest.warns(UserWarning, match="a negative value was tapped"), hcb.taps_delivered():
        step(-jnp.ones(3))


def test_no_warning_is_recorded_when_the_taps_do_not_warn(transport):
    with warnings.catch_warnings(record=True) as caught, hcb.taps_delivered():
        warnings.simplefilter("always")
        step(jnp.ones(3))
    assert [str(w.message) for w in caught] == []


def test_a_tap_error_is_raised_when_the_block_ends(transport):
    def fails(value, transforms):
        raise ValueError("bad value")

    with pytest.raises(hcb.CallbackException, match="bad value"):
        with hcb.taps_delivered(timeout=60):
            jax.jit(lambda x: hcb.id_tap(fails, x))(1)
