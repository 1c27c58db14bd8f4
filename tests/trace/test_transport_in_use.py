"""Which transport ran: the lowered program names it, and barrier markers follow it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from helpers import run_python
from hostcallback import config
from hostcallback._records import handover
from hostcallback._records.registry import BARRIER_MARKER_ID

JAX_CALLBACK_TARGET = "xla_ffi_python_cpu_callback"


def _lower_tap_and_call() -> str:
    """A fresh function each time: the transport is chosen when a tap is traced, and JAX
    would reuse an earlier trace of the same function."""

    def tap_and_call(x):
        hcb.id_tap(lambda *a: None, x)
        return hcb.call(lambda v: v, x, result_shape=x)

    return jax.jit(tap_and_call).lower(jnp.arange(3.0)).as_text()


def test_the_native_transport_lowers_to_our_custom_calls():
    with config.override(transport="native"):
        text = _lower_tap_and_call()
    assert "@hostcallback_tap" in text and "@hostcallback_call" in text
    assert JAX_CALLBACK_TARGET not in text


def _lower_for_cuda(**settings) -> str:
    with config.override(**settings):
        tapped = jax.jit(lambda x: hcb.id_tap(lambda *a: None, x * 2))
        return tapped.trace(np.ones(3, np.float32)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.needs_internals("the GPU tap (its taps on a GPU take JAX's callbacks)")
def test_a_native_tap_lowered_for_a_cuda_gpu_is_the_gpu_tap_without_a_fence_by_default():
    """On a CUDA device the same custom call runs the GPU tap (registered for CUDA); the GPU
    fence only with HOSTCALLBACK_GPU_FENCE=1."""
    text = _lower_for_cuda(transport="native")
    assert text.count("@hostcallback_tap(") == 1 and "hostcallback_fence" not in text
    assert JAX_CALLBACK_TARGET not in text


@pytest.mark.needs_internals("the GPU tap (its taps on a GPU take JAX's callbacks)")
@pytest.mark.parametrize("delivery", ["handled", "async"])
def test_with_the_gpu_fence_asked_for_a_gpu_computation_has_its_begin_and_fence(delivery):
    result = run_python(f"""
        import jax, numpy as np
        import hostcallback as hcb
        hcb.configure(delivery={delivery!r})
        tapped = jax.jit(lambda x: hcb.id_tap(lambda *a: None, x * 2))
        text = tapped.trace(np.ones(3, np.float32)).lower(lowering_platforms=("cuda",)).as_text()
        print(text.count("@hostcallback_tap("), text.count("@hostcallback_begin("),
              text.count("@hostcallback_fence("))
        """, env={"HOSTCALLBACK_GPU_FENCE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == (["1", "1", "1"] if delivery == "handled" else ["1", "0", "0"])


def test_the_callback_transport_lowers_to_jax_host_callbacks():
    with config.override(transport="callback"):
        text = _lower_tap_and_call()
    assert text.count(JAX_CALLBACK_TARGET) >= 2  # one for the tap, one for the call
    assert "hostcallback_tap" not in text and "hostcallback_call" not in text


class _CountingOutfeed:
    """Stands in for the native module where the callback transport's taps are queued
    (handover.py); counts enqueues."""

    def __init__(self, real):
        self._real, self.consumer_ids = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def enqueue(self, ordinal, consumer_id, leaves, **kwargs):
        self.consumer_ids.append(consumer_id)
        return self._real.enqueue(ordinal, consumer_id, leaves, **kwargs)


@pytest.mark.timeout(120)
@pytest.mark.needs_internals("barrier markers sent by computations on the transport in use (its "
                             "barrier puts the markers in the queues from the host)")
def test_barrier_markers_use_the_transport_in_use_now(monkeypatch):
    counting = _CountingOutfeed(handover.outfeed)
    monkeypatch.setattr(handover, "outfeed", counting)
    jax.jit(lambda x: hcb.id_tap(lambda *a: None, x))(1.0)  # starts the receivers
    with config.override(transport="native"):
        hcb.barrier_wait()
    assert BARRIER_MARKER_ID not in counting.consumer_ids
    with config.override(transport="callback"):
        hcb.barrier_wait()
    devices = len(jax.local_devices())
    # One single-device marker per device and one all-devices marker sent from each device.
    assert counting.consumer_ids.count(BARRIER_MARKER_ID) == 2 * devices
    counting.consumer_ids.clear()
    with config.override(transport="native"):
        hcb.barrier_wait()
    assert BARRIER_MARKER_ID not in counting.consumer_ids
    assert np.all(np.asarray(jax.jit(lambda x: x + 1)(jnp.zeros(2))) == 1)
