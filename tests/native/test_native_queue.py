"""The outfeed queues: keyed by platform and device, byte budget, backpressure, oversize records
in arrival order, statistics.

The tests that take ``transport`` watch the receivers deliver real taps; the others drive queues
of a platform no receiver drains, so each owns its queue and reads the records itself.
"""

import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from helpers import TEST_PLATFORM, drain_one, fresh_queue, run_python, wait_until
from hostcallback import config
from hostcallback._host.receiver import devices_to_receive, queue_key
from hostcallback._native import outfeed
from hostcallback._records import wire

leaf = wire.as_leaf


def device_stats():
    return hcb.queue_stats()[jax.devices()[0]]


def hold_until_the_device_waits(timeout_s: float = 30.0) -> None:
    """Called by a consumer on its first record: the queue then fills whatever the machine's
    speed, so the device must wait (the test fails on waits, not on this timeout)."""
    deadline = time.monotonic() + timeout_s
    while device_stats()["producers_waiting"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)


def test_queues_are_keyed_by_platform_and_id():
    device = fresh_queue()
    outfeed.enqueue(device, 1, [leaf(np.int32(5))], platform=TEST_PLATFORM)
    assert outfeed.stats(device, platform=TEST_PLATFORM)["records_enqueued"] == 1
    assert outfeed.stats(device, platform="other")["records_enqueued"] == 0
    assert outfeed.stats(device)["records_enqueued"] == 0  # ("cpu", id) is another queue
    assert outfeed.drain_raw(device, 10, 1 << 20, 0.001, platform="other") == []
    assert wire.decode_record(drain_one(device)).arrays[0] == 5


def test_receivers_cover_the_default_backend_and_the_native_platform():
    def dev(platform, i):
        return types.SimpleNamespace(platform=platform, id=i)

    gpus, cpus = [dev("gpu", 0), dev("gpu", 1)], [dev("cpu", 0)]
    assert [queue_key(d) for d in devices_to_receive(gpus, cpus)] == [
        ("gpu", 0), ("gpu", 1), ("cpu", 0)]
    assert [queue_key(d) for d in devices_to_receive(cpus, cpus)] == [("cpu", 0)]
    assert {queue_key(d) for d in jax.local_devices()} <= {
        queue_key(d) for d in hcb.queue_stats()}


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


@pytest.mark.timeout(60)
def test_a_record_larger_than_the_budget_is_not_overtaken_by_small_ones():
    device = fresh_queue()

    def enqueue(value, size):
        outfeed.enqueue(device, 1, [leaf(np.full(size, value, np.uint8))], platform=TEST_PLATFORM)

    with config.override(max_queue_bytes=64 << 10):
        enqueue(1, 1000)  # the queue is not empty, so the large record must wait
        large = threading.Thread(target=enqueue, args=(2, 256 << 10), daemon=True)
        large.start()
        wait_until(lambda: outfeed.stats(device, platform=TEST_PLATFORM)["producers_waiting"] == 1)
        small = threading.Thread(target=enqueue, args=(3, 1000), daemon=True)
        small.start()  # fits the budget, but came later: it waits behind the large one
        wait_until(lambda: outfeed.stats(device, platform=TEST_PLATFORM)["producers_waiting"] == 2)
        order = []
        while len(order) < 3:
            for raw in outfeed.drain_raw(device, 10, 1 << 30, 5.0, platform=TEST_PLATFORM):
                order.append(int(wire.decode_record(raw).arrays[0][0]))
        large.join(30)
        small.join(30)
    assert order == [1, 2, 3]


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


def test_peak_bytes_queued_can_be_reset(transport, collector):
    jax.jit(lambda x: hcb.id_tap(collector, x))(jnp.zeros(1 << 14, jnp.float32))
    hcb.barrier_wait()
    assert device_stats()["peak_bytes_queued"] >= 64 << 10
    hcb.reset_peak_bytes_queued()
    assert all(s["peak_bytes_queued"] == s["bytes_queued"] for s in hcb.queue_stats().values())


def test_the_budget_comes_from_the_environment(tmp_path):
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


def test_a_drained_batch_never_holds_more_than_the_budget():
    device = fresh_queue()
    for _ in range(8):
        outfeed.enqueue(device, 1, [leaf(np.zeros(16 << 10, np.uint8))], platform=TEST_PLATFORM)
    with config.override(max_queue_bytes=40 << 10):
        batch = outfeed.drain_raw(device, 100, 1 << 30, 1.0, platform=TEST_PLATFORM)
    assert sum(r.size for r in batch) <= (40 << 10) + batch[-1].size
    assert len(batch) < 8
