"""The outfeed queues: byte budget, backpressure, oversize records, statistics."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from hostcallback import config


def device_stats():
    return hcb.queue_stats()[jax.devices()[0]]


def hold_until_the_device_waits(timeout_s: float = 30.0) -> None:
    """Called by a consumer on its first record: the queue then fills whatever the machine's
    speed, so the device must wait (the test fails on waits, not on this timeout)."""
    deadline = time.monotonic() + timeout_s
    while device_stats()["producers_waiting"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)


def test_a_full_queue_makes_the_device_wait_and_drops_nothing(transport, collector):
    def slow(arg, transforms):
        if not collector.values:
            hold_until_the_device_waits()
        collector(int(arg[0]), transforms)

    before = device_stats()
    with config.override(max_queue_bytes=64 * 1024):
        loop = jax.jit(lambda x: lax.fori_loop(
            0, 40, lambda i, c: (hcb.id_tap(slow, c + i), c)[1], x))
        loop(jnp.zeros(4096, jnp.float32))  # 16 KiB per record: at most 4 fit
        hcb.barrier_wait()
    after = device_stats()
    assert collector.values == list(range(40))
    assert after["waits"] > before["waits"]
    assert after["wait_seconds"] > before["wait_seconds"]
    assert after["peak_bytes_queued"] >= 16 * 1024


def test_a_record_larger_than_the_budget_is_still_delivered(transport, collector):
    with config.override(max_queue_bytes=64 * 1024):
        value = np.arange(1 << 20, dtype=np.float32)  # 4 MiB, 64 times the budget
        jax.jit(lambda x: hcb.id_tap(collector, x))(value)
        hcb.barrier_wait()
    np.testing.assert_array_equal(collector.values[0], value)


@pytest.mark.needs_internals("the device of callback-transport records", transport="callback")
def test_large_taps_copied_on_several_threads_arrive_intact_on_every_device(transport,
                                                                          collector):
    # Over 1 MiB, not a whole number of the copy's 256 KiB chunks, different on each device.
    values = np.random.default_rng(0).integers(0, 255, (4, (5 << 18) + 12345), np.uint8)
    jax.pmap(lambda x: lax.fori_loop(0, 3, lambda i, c: hcb.id_tap(
        collector, c, tap_with_device=True) + 1, x))(values)
    hcb.barrier_wait()
    by_device = {}
    for value, _, device in collector.calls:
        by_device.setdefault(device.id, []).append(value.tobytes())
    assert by_device == {device.id: [(values[i] + k).astype(np.uint8).tobytes() for k in range(3)]
                         for i, device in enumerate(jax.local_devices())}


def test_statistics_count_records_and_bytes(transport, collector):
    before = device_stats()
    jax.jit(lambda x: lax.fori_loop(0, 10, lambda i, c: hcb.id_tap(collector, c), x))(
        jnp.zeros(256, jnp.float32))
    hcb.barrier_wait()
    after = device_stats()
    # 10 taps; the barrier's 2 markers for this device are counted apart
    assert after["records_enqueued"] - before["records_enqueued"] == 10
    assert after["barrier_markers_enqueued"] - before["barrier_markers_enqueued"] == 2
    assert after["records_delivered"] == after["records_enqueued"]
    assert after["records_handled"] == after["records_enqueued"]
    assert after["bytes_enqueued"] - before["bytes_enqueued"] >= 10 * 1024
    assert after["bytes_queued"] == 0


def test_the_budget_comes_from_the_environment(tmp_path):
    from conftest import run_python

    result = run_python("""
        import hostcallback as hcb
        from hostcallback import config
        from hostcallback._native import outfeed
        import jax
        hcb.id_tap(lambda a, t: None, 1.0)
        hcb.barrier_wait()
        print(config.settings.max_queue_bytes, outfeed.max_queue_bytes())
        """, env={"HOSTCALLBACK_MAX_QUEUE_BYTES": "12345"}, devices=1)
    assert result.stdout.split() == ["12345", "12345"], result.stderr


def test_a_bad_budget_in_the_environment_is_a_clear_error():
    from conftest import run_python

    result = run_python("import hostcallback", env={"HOSTCALLBACK_MAX_QUEUE_BYTES": "lots"},
                        devices=1)
    assert result.returncode != 0
    assert "HOSTCALLBACK_MAX_QUEUE_BYTES='lots' is not an integer" in result.stderr


def test_a_slow_consumer_of_taps_larger_than_a_small_budget_gets_every_one(transport, collector):
    def slow(arg, transforms):
        if not collector.values:
            hold_until_the_device_waits()
        collector(float(arg[0]), transforms)

    before = device_stats()
    with config.override(max_queue_bytes=1 << 20):  # 1 MiB budget, 4 MiB taps
        loop = jax.jit(lambda x: lax.fori_loop(
            0, 8, lambda i, c: (hcb.id_tap(slow, c + i), c)[1], x))
        loop(jnp.zeros(1 << 20, jnp.float32))
        hcb.barrier_wait()
    after = device_stats()
    assert collector.values == [float(i) for i in range(8)]
    assert after["waits"] > before["waits"]
    assert after["peak_bytes_queued"] <= (4 << 20) + 4096  # one oversize record at a time
