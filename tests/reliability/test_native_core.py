"""The C++ core on its own: record bytes, ownership, keying, call responses, timeouts, fairness.

These drive queues of a platform no receiver drains ("test"), so each test owns its queue and
reads the records itself.
"""

import itertools
import math
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from hostcallback import config, wire
from hostcallback._native import outfeed
from hostcallback.receiver import devices_to_receive, queue_key

PLATFORM = "test"
_next_device = itertools.count(100)


def fresh_queue() -> int:
    """A device id of the "test" platform that no other test uses."""
    return next(_next_device)


leaf = wire.as_leaf


def poll(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.002)


def drain_one(device):
    (raw,) = outfeed.drain_raw(device, 1, 1 << 30, 5.0, platform=PLATFORM)
    return raw


ARRAY_SETS = [
    [np.arange(3, dtype=np.int8)],
    [np.float32(1.5), np.arange(7, dtype=np.int16).reshape(7, 1), np.zeros((0, 3), np.float64)],
    [np.ones(5, np.bool_), np.arange(33, dtype=np.uint8), np.full((2, 2), -1, np.int64)],
]


@pytest.mark.parametrize("arrays", ARRAY_SETS)
def test_the_cpp_and_python_encoders_give_identical_bytes(arrays):
    device = fresh_queue()
    outfeed.enqueue(device, 7, [leaf(a) for a in arrays], platform=PLATFORM)
    raw = drain_one(device)
    sequence = wire.decode_record(raw).sequence
    assert bytes(raw) == wire.encode_record(7, device, sequence, arrays)


# Each pair: a record of 0xFF bytes, then one of the same pooled size whose arrays leave gaps
# where the first had data (a 1-byte array, then the next one 63 bytes on).
RECYCLED = {
    "large": ([np.full(1 << 16, 0xFF, np.uint8)],
              [np.ones(1, np.uint8), np.full((1 << 16) - 64, 7, np.uint8)]),
    "small": ([np.full(128, 0xFF, np.uint8)], [np.ones(1, np.uint8), np.full(1, 7, np.uint8)]),
}


@pytest.mark.parametrize("old, new", RECYCLED.values(), ids=RECYCLED.keys())
def test_padding_in_a_recycled_buffer_is_zero(old, new):
    device = fresh_queue()
    outfeed.enqueue(device, 1, [leaf(a) for a in old], platform=PLATFORM)
    first = drain_one(device)
    assert first.size == len(wire.encode_record(1, device, 0, new))  # the same pooled size
    dirtied = first.__array_interface__["data"][0]
    del first  # back to the pool
    outfeed.enqueue(device, 2, [leaf(a) for a in new], platform=PLATFORM)
    raw = drain_one(device)
    assert raw.__array_interface__["data"][0] == dirtied  # the recycled buffer, not a fresh one
    assert bytes(raw) == wire.encode_record(2, device, 1, new)


def test_drained_records_are_read_only_and_cannot_be_made_writable():
    device = fresh_queue()
    outfeed.enqueue(device, 1, [leaf(np.arange(4, dtype=np.int32))], platform=PLATFORM)
    raw = drain_one(device)
    assert not raw.flags.writeable
    with pytest.raises(ValueError):
        raw[40] = 0  # the record-size field a writable array let consumers change
    with pytest.raises(ValueError):
        raw.flags.writeable = True


def test_queues_are_keyed_by_platform_and_id():
    device = fresh_queue()
    outfeed.enqueue(device, 1, [leaf(np.int32(5))], platform=PLATFORM)
    assert outfeed.stats(device, platform=PLATFORM)["records_enqueued"] == 1
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


def answer_calls(device, answer):
    """Drains call records of one test queue and answers each with ``answer(value)``."""
    raw = drain_one(device)
    record = wire.decode_record(raw)
    assert record.expects_response
    outfeed.respond(device, record.sequence, [answer(record.arrays[0]).reshape(-1).view(np.uint8)],
                    platform=PLATFORM)
    return record.sequence


def call_in_thread(device, value, timeout_s):
    out = {}

    def run():
        try:
            out["answer"] = outfeed.call(device, 3, [leaf(np.int32(value))], timeout_s,
                                         platform=PLATFORM)
        except Exception as error:  # noqa: BLE001 - the test checks it
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def response_tables(device):
    stats = outfeed.stats(device, platform=PLATFORM)
    return stats["calls_waiting"], stats["answers_unclaimed"]


@pytest.mark.timeout(60)
def test_an_answered_call_leaves_the_response_tables_empty():
    device = fresh_queue()
    thread, out = call_in_thread(device, 20, 30.0)
    poll(lambda: outfeed.stats(device, platform=PLATFORM)["records_enqueued"] == 1)
    assert response_tables(device) == (1, 0)
    answer_calls(device, lambda v: np.asarray(v + 1, np.int32))
    thread.join(30)
    assert np.frombuffer(out["answer"][0], np.int32)[0] == 21
    assert response_tables(device) == (0, 0)


@pytest.mark.timeout(60)
def test_a_timed_out_call_and_its_late_answer_leave_the_tables_empty():
    device = fresh_queue()
    thread, out = call_in_thread(device, 1, 0.05)
    thread.join(30)
    assert "did not answer this call within its timeout" in str(out["error"])
    assert response_tables(device) == (0, 0)
    answer_calls(device, lambda v: np.asarray(v, np.int32))  # too late: dropped
    assert response_tables(device) == (0, 0)


@pytest.mark.timeout(60)
def test_a_failed_queue_fails_waiting_and_future_calls_with_the_reason():
    device = fresh_queue()
    thread, out = call_in_thread(device, 1, 0.0)  # 0: no timeout
    poll(lambda: response_tables(device) == (1, 0))
    outfeed.fail(device, "the receiver died: because of a test", platform=PLATFORM)
    thread.join(30)
    assert "because of a test" in str(out["error"])
    assert response_tables(device) == (0, 0)
    with pytest.raises(RuntimeError, match="because of a test"):
        outfeed.enqueue(device, 1, [leaf(np.int32(1))], platform=PLATFORM)


@pytest.mark.timeout(60)
def test_an_infinite_timeout_waits_until_the_answer_comes():
    device = fresh_queue()
    thread, out = call_in_thread(device, 4, math.inf)
    poll(lambda: response_tables(device) == (1, 0))
    answer_calls(device, lambda v: np.asarray(v * 2, np.int32))
    thread.join(30)
    assert np.frombuffer(out["answer"][0], np.int32)[0] == 8


@pytest.mark.parametrize("timeout", [math.inf, 1e10, 1e300])
def test_call_with_an_infinite_or_huge_timeout_returns_the_answer(transport, timeout):
    f = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) + 1, x, result_shape=x,
                                   timeout=timeout))
    assert f(jnp.float32(1)) == 2.0


@pytest.mark.parametrize("timeout", [-1.0, math.nan, 0])
def test_a_negative_nan_or_zero_timeout_is_a_clear_error(timeout):
    with pytest.raises(ValueError, match="timeout"):
        hcb.call(lambda v: v, 1.0, result_shape=1.0, timeout=timeout)


@pytest.mark.parametrize("timeout", [-1.0, math.nan])
def test_the_core_refuses_negative_and_nan_timeouts(timeout):
    with pytest.raises(ValueError, match="timeout"):
        outfeed.drain_raw(fresh_queue(), 1, 1, timeout, platform=PLATFORM)
    with pytest.raises(ValueError, match="timeout"):
        outfeed.call(fresh_queue(), 1, [], timeout, platform=PLATFORM)


@pytest.mark.timeout(60)
def test_a_record_larger_than_the_budget_is_not_overtaken_by_small_ones():
    device = fresh_queue()

    def enqueue(value, size):
        outfeed.enqueue(device, 1, [leaf(np.full(size, value, np.uint8))], platform=PLATFORM)

    with config.override(max_queue_bytes=64 << 10):
        enqueue(1, 1000)  # the queue is not empty, so the large record must wait
        large = threading.Thread(target=enqueue, args=(2, 256 << 10), daemon=True)
        large.start()
        poll(lambda: outfeed.stats(device, platform=PLATFORM)["producers_waiting"] == 1)
        small = threading.Thread(target=enqueue, args=(3, 1000), daemon=True)
        small.start()  # fits the budget, but came later: it waits behind the large one
        poll(lambda: outfeed.stats(device, platform=PLATFORM)["producers_waiting"] == 2)
        order = []
        while len(order) < 3:
            for raw in outfeed.drain_raw(device, 10, 1 << 30, 5.0, platform=PLATFORM):
                order.append(int(wire.decode_record(raw).arrays[0][0]))
        large.join(30)
        small.join(30)
    assert order == [1, 2, 3]


@pytest.mark.timeout(60)
def test_a_call_times_out_while_its_queue_stays_full_and_the_line_moves_on():
    device = fresh_queue()
    stats = lambda: outfeed.stats(device, platform=PLATFORM)
    errors = []

    def call():
        try:
            outfeed.call(device, 5, [leaf(np.int32(1))], 0.5, platform=PLATFORM)
        except RuntimeError as error:
            errors.append(str(error))

    with config.override(max_queue_bytes=64 << 10):
        outfeed.enqueue(device, 1, [leaf(np.zeros(80 << 10, np.uint8))], platform=PLATFORM)  # full
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        poll(lambda: stats()["producers_waiting"] == 1)
        behind = threading.Thread(target=outfeed.enqueue, daemon=True, args=(
            device, 1, [leaf(np.full(1000, 7, np.uint8))]), kwargs={"platform": PLATFORM})
        behind.start()  # waits for room, behind the call in line
        poll(lambda: stats()["producers_waiting"] == 2)
        caller.join(30)
        assert len(errors) == 1 and "within its timeout of 0.5" in errors[0]
        assert "queue stayed full" in errors[0]
        outfeed.drain_raw(device, 1, 1 << 30, 5.0, platform=PLATFORM)  # room again
        (raw,) = outfeed.drain_raw(device, 10, 1 << 30, 5.0, platform=PLATFORM)
        behind.join(30)
    assert wire.decode_record(raw).arrays[0][0] == 7  # not stuck behind the call that gave up
    assert stats()["calls_waiting"] == 0 and stats()["producers_waiting"] == 0


@pytest.mark.timeout(120)
def test_pool_stats_does_not_deadlock_when_the_garbage_collector_frees_a_record():
    from conftest import run_python

    result = run_python("""
        import gc
        import numpy as np
        from hostcallback import wire
        from hostcallback._native import outfeed

        outfeed.enqueue(0, 3, [wire.as_leaf(np.zeros(1 << 16, np.float32))], platform="gc")
        (records, _) = outfeed.drain(0, 10, 1 << 30, 5.0, platform="gc")
        class Cycle: pass
        cycle = Cycle()
        cycle.itself, cycle.array = cycle, records[0][4][0]  # a pooled record's only view
        del records, cycle
        gc.disable(); gc.set_threshold(1)
        junk = [dict() for _ in range(1000)]; del junk  # the next allocation collects
        gc.enable()
        outfeed.pool_stats()  # the collector may free the record in here: it once hung
        gc.collect()
        print(outfeed.pool_stats()["records_held"])
        """, devices=1, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0"]


def test_peak_bytes_queued_can_be_reset(transport, collector):
    jax.jit(lambda x: hcb.id_tap(collector, x))(jnp.zeros(1 << 14, jnp.float32))
    hcb.barrier_wait()
    assert hcb.queue_stats()[jax.devices()[0]]["peak_bytes_queued"] >= 64 << 10
    hcb.reset_peak_bytes_queued()
    assert all(s["peak_bytes_queued"] == s["bytes_queued"] for s in hcb.queue_stats().values())


def test_a_drained_batch_never_holds_more_than_the_budget():
    device = fresh_queue()
    for _ in range(8):
        outfeed.enqueue(device, 1, [leaf(np.zeros(16 << 10, np.uint8))], platform=PLATFORM)
    with config.override(max_queue_bytes=40 << 10):
        batch = outfeed.drain_raw(device, 100, 1 << 30, 1.0, platform=PLATFORM)
    assert sum(r.size for r in batch) <= (40 << 10) + batch[-1].size
    assert len(batch) < 8
