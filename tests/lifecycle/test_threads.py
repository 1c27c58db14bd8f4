"""Eight Python threads dispatch computations with taps while others call barrier_wait."""

import threading

import jax
import jax.numpy as jnp
import pytest

import hostcallback as hcb


@pytest.mark.needs_internals("the device of callback-transport records, which this test's "
                             "per-device order needs", transport="callback")
def test_eight_dispatching_threads_and_concurrent_barriers(transport, collector):
    tap_single = jax.jit(lambda x: hcb.id_tap(collector, x))
    tap_all = jax.pmap(lambda x: hcb.id_tap(collector, x))
    errors = []

    def dispatch(thread_index):
        try:
            for i in range(25):
                value = thread_index * 1000 + i
                if i % 5 == 0:
                    tap_all(jnp.full(4, value))
                else:
                    tap_single(value)
                if i % 10 == 9:
                    hcb.barrier_wait(timeout=120)
        except Exception as error:  # noqa: BLE001 (reported below, with the thread's failure)
            errors.append(error)

    threads = [threading.Thread(target=dispatch, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    hcb.barrier_wait(timeout=120)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)
    expected = sorted([t * 1000 + i for t in range(8) for i in range(25) if i % 5] +
                      [t * 1000 + i for t in range(8) for i in range(0, 25, 5)] * 4)
    assert sorted(int(v) for v in collector.values) == expected
