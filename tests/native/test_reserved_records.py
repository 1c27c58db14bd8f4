"""The two-step join of a GPU tap, driven from the host on queues no receiver drains: room reserved
at launch counts against the budget and keeps producers in line, the record joins at commit in
commit order, and a queue closed in between refuses it and gives the room back. On a GPU the
handler takes these steps (cuda_tap.cc); tests/gpu runs it there."""

import threading
import time

import numpy as np
import pytest

from helpers import TEST_PLATFORM, drain_one, fresh_queue, wait_until
from hostcallback import config
from hostcallback._host.receiver import cuda_device_ids
from hostcallback._native import outfeed
from hostcallback._records import wire

leaf = wire.as_leaf
BUDGET = 64 << 10


def record_bytes(value) -> int:
    """What a record of this one value weighs against the budget."""
    device = fresh_queue()
    outfeed.enqueue(device, 1, [leaf(np.asarray(value))], platform=TEST_PLATFORM)
    return len(drain_one(device))


def stats(device):
    return outfeed.stats(device, platform=TEST_PLATFORM)


def waiting_producer(device) -> threading.Thread:
    """A tap of consumer 3 enqueued from another thread, once it waits for room."""
    producer = threading.Thread(target=outfeed.enqueue, args=(device, 3, [leaf(np.int32(3))]),
                                kwargs={"platform": TEST_PLATFORM})
    producer.start()
    wait_until(lambda: stats(device)["producers_waiting"] == 1, what="the producer waits")
    return producer


def test_a_committed_record_arrives_whole_with_the_next_sequence_number():
    device = fresh_queue()
    value = np.arange(10, dtype=np.float32)
    outfeed.enqueue(device, 1, [leaf(np.int32(0))], platform=TEST_PLATFORM)
    outfeed.reserve(device, record_bytes(value), platform=TEST_PLATFORM)
    sequence = outfeed.commit(device, 7, [leaf(value)], record_bytes(value), platform=TEST_PLATFORM)
    assert sequence == 1
    drain_one(device)
    record = wire.decode_record(drain_one(device))
    assert record.consumer_id == 7 and record.sequence == 1
    np.testing.assert_array_equal(record.arrays[0], value)
    assert stats(device)["bytes_queued"] == 0


def test_records_join_in_commit_order_whatever_order_they_reserved_in():
    device = fresh_queue()
    size = record_bytes(np.int32(0))
    outfeed.reserve(device, size, platform=TEST_PLATFORM)
    outfeed.reserve(device, size, platform=TEST_PLATFORM)
    outfeed.commit(device, 2, [leaf(np.int32(2))], size, platform=TEST_PLATFORM)
    outfeed.commit(device, 1, [leaf(np.int32(1))], size, platform=TEST_PLATFORM)
    assert [wire.decode_record(drain_one(device)).consumer_id for _ in range(2)] == [2, 1]


def test_a_reservation_holds_its_room_until_its_record_is_drained():
    device = fresh_queue()
    big = np.zeros((BUDGET - 4096) // 4, dtype=np.int32)
    size = record_bytes(big)
    with config.override(max_queue_bytes=size):
        outfeed.reserve(device, size, platform=TEST_PLATFORM)
        assert stats(device)["bytes_reserved"] == size
        later = waiting_producer(device)
        outfeed.commit(device, 1, [leaf(big)], size, platform=TEST_PLATFORM)
        assert (stats(device)["bytes_reserved"], stats(device)["bytes_queued"]) == (0, size)
        time.sleep(0.2)  # time enough for a producer let in by mistake to go in
        assert stats(device)["producers_waiting"] == 1
        assert wire.decode_record(drain_one(device)).consumer_id == 1
        later.join(timeout=10)
        assert not later.is_alive()
        assert wire.decode_record(drain_one(device)).consumer_id == 3


def test_a_reservation_waits_in_line_behind_a_full_queue():
    device = fresh_queue()
    with config.override(max_queue_bytes=BUDGET):
        big = np.zeros((BUDGET - 4096) // 4, dtype=np.int32)
        outfeed.enqueue(device, 1, [leaf(big)], platform=TEST_PLATFORM)
        reserving = threading.Thread(target=outfeed.reserve, args=(device, BUDGET),
                                     kwargs={"platform": TEST_PLATFORM})
        reserving.start()
        wait_until(lambda: stats(device)["producers_waiting"] == 1, what="the reservation waits")
        drain_one(device)
        reserving.join(timeout=10)
        assert not reserving.is_alive()
        outfeed.cancel_reservation(device, BUDGET, platform=TEST_PLATFORM)


def test_cancelling_a_reservation_lets_the_next_producer_in():
    device = fresh_queue()
    with config.override(max_queue_bytes=BUDGET):
        outfeed.reserve(device, BUDGET, platform=TEST_PLATFORM)
        later = waiting_producer(device)
        outfeed.cancel_reservation(device, BUDGET, platform=TEST_PLATFORM)
        later.join(timeout=10)
        assert not later.is_alive()
        assert wire.decode_record(drain_one(device)).consumer_id == 3


def test_a_queue_closed_between_reserve_and_commit_refuses_the_record_and_frees_its_room():
    device = fresh_queue()
    size = record_bytes(np.int32(0))
    outfeed.reserve(device, size, platform=TEST_PLATFORM)
    outfeed.fail(device, "stopped for the test", platform=TEST_PLATFORM)
    with pytest.raises(RuntimeError, match="stopped for the test"):
        outfeed.commit(device, 1, [leaf(np.int32(1))], size, platform=TEST_PLATFORM)
    assert stats(device)["bytes_reserved"] == 0
    with pytest.raises(RuntimeError, match="stopped for the test"):
        outfeed.reserve(device, size, platform=TEST_PLATFORM)
    assert stats(device)["records_enqueued"] == 0


def test_cuda_ordinals_map_to_global_device_ids():
    def gpu(ordinal, ident):
        return type("Device", (), {"platform": "gpu", "local_hardware_id": ordinal, "id": ident})

    cpu = type("Device", (), {"platform": "cpu", "local_hardware_id": 0, "id": 0})
    assert cuda_device_ids([gpu(1, 9), gpu(0, 8), cpu]) == [8, 9]
    assert cuda_device_ids([gpu(2, 4)]) == [-1, -1, 4]
    assert cuda_device_ids([cpu]) == []
