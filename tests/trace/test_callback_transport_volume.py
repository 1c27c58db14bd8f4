"""The callback transport at volume: 100k taps over four devices, each delivered once, in order."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from hostcallback import config

DEVICES = 4
TAPS_PER_DEVICE = 25_000


@pytest.mark.timeout(300)
@pytest.mark.needs_internals("the device of callback-transport records")
def test_100k_callback_taps_over_4_devices_arrive_once_each_in_order_per_device():
    received = collections.defaultdict(list)

    def keep(value, transforms, device):
        received[device.id].append(int(value))

    def taps(x):
        def step(i, carry):
            hcb.id_tap(keep, carry[0] * TAPS_PER_DEVICE + i, tap_with_device=True)
            return carry

        return lax.fori_loop(0, TAPS_PER_DEVICE, step, x)

    with config.override(transport="callback"):
        out = jax.pmap(taps)(jnp.arange(DEVICES, dtype=jnp.int32).reshape(DEVICES, 1))
        out.block_until_ready()
        hcb.barrier_wait()
    devices = jax.local_devices()[:DEVICES]
    assert sorted(received) == sorted(d.id for d in devices)
    for position, device in enumerate(devices):
        values = received[device.id]
        start = position * TAPS_PER_DEVICE
        assert len(values) == TAPS_PER_DEVICE
        np.testing.assert_array_equal(values, np.arange(start, start + TAPS_PER_DEVICE))
