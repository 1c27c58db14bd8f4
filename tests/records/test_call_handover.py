"""A call on the callback transport hands its arguments and answer over in Python, without a
copy (hostcallback/_records/handover.py): the function sees what a decoded record would show it,
and a call that ends early leaves nothing behind."""

import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hostcallback as hcb
from helpers import memory_owner
from hostcallback._records import handover, wire


@pytest.fixture(autouse=True)
def callback_transport():
    with hcb.config.override(transport="callback"):
        yield


@pytest.mark.parametrize("value", [np.float32(2.5), np.arange(6, dtype=np.int16).reshape(2, 3),
                                   np.array([True, False]),
                                   np.arange(4).astype(ml_dtypes.bfloat16)],
                         ids=["0-d", "int16 2x3", "bool", "bfloat16"])
def test_the_function_gets_read_only_arrays_equal_to_the_arguments(value):
    seen = []

    def host(v):
        seen.append(v)
        return v  # the answer is the argument itself

    out = jax.jit(lambda x: hcb.call(host, x, result_shape=x))(value)
    (got,) = seen
    assert isinstance(got, np.ndarray) and not got.flags.writeable
    assert got.dtype == value.dtype and got.shape == np.shape(value)
    np.testing.assert_array_equal(got, value)
    np.testing.assert_array_equal(out, value)


@pytest.mark.needs_internals("the callback transport's own host callback (the portable mode "
                             "hands over views of jax.Arrays, which keep their buffers)")
def test_the_arrays_jax_hands_a_host_callback_own_their_memory():
    """What the handover rests on: the receiver may still read a call's arguments after a caller
    that timed out returned to JAX, so they must not be views of XLA's buffers."""
    seen = []

    def host(v):
        seen.append(v)
        return v

    jax.jit(lambda x: hcb.call(host, x, result_shape=x))(jnp.arange(1024.0))
    (got,) = seen
    owner = memory_owner(got)
    assert isinstance(owner, np.ndarray) and owner.flags.owndata


def test_a_late_answer_to_a_call_that_timed_out_leaves_nothing_behind():
    started = threading.Event()

    def slow(v):
        started.set()
        time.sleep(0.8)
        return v

    # The function has begun before the caller gives up: its answer comes late.
    with pytest.raises(Exception, match="did not answer this call within its timeout"):
        jax.jit(lambda x: hcb.call(slow, x, result_shape=x, timeout=0.5))(1.0).block_until_ready()
    hcb.barrier_wait()  # the late answer has been given by now
    assert started.is_set()
    assert handover._answers == {} and handover._arguments == {}
    assert jax.jit(lambda x: hcb.call(lambda v: v, x, result_shape=x))(3.0) == 3.0


def test_an_argument_of_a_dtype_records_cannot_hold_is_refused_clearly():
    with pytest.raises(wire.UnsupportedDtypeError, match="dtype <U4 cannot be tapped"):
        handover.call_and_wait(0, 1, [np.array(["text"])], 1.0, platform="cpu")
    assert handover._arguments == {}


def test_a_large_answer_reaches_the_computation_whole():
    x = jnp.arange(1 << 20, dtype=jnp.float32)
    out = jax.jit(lambda v: hcb.call(lambda a: np.asarray(a) + 1, v, result_shape=v))(x)
    np.testing.assert_array_equal(out, np.arange(1 << 20, dtype=np.float32) + 1)
