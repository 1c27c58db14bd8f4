"""A large tap made from Python (the callback transport) hands its arrays over without a copy
(hostcallback/_records/handover.py): its record carries a ticket, the queue's budget counts the
arrays, the consumer sees them read-only, and nothing is left behind."""

import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import TEST_PLATFORM, fresh_queue, memory_owner
from hostcallback._native import outfeed
from hostcallback._records import handover, wire
from hostcallback._records.record_layout import FLAGS, LEAVES

LARGE = handover.TAP_HANDOVER_MIN_BYTES


def drained(device: int) -> list:
    records, _ = outfeed.drain(device, 100, 1 << 30, 5.0, platform=TEST_PLATFORM)
    return records


def tapped_on_the_callback_transport(value) -> np.ndarray:
    """What a consumer of an id_tap of ``value`` under jit gets on the callback transport."""
    seen = []
    with hcb.config.override(transport="callback"):
        jax.jit(lambda x: hcb.id_tap(lambda v, _: seen.append(v), x))(value)
        hcb.barrier_wait()
    (got,) = seen
    return got


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_, ml_dtypes.bfloat16])
@pytest.mark.needs_internals("the callback transport's own host callback (the portable mode "
                             "hands over views of jax.Arrays, which are copied)")
def test_a_large_tap_reaches_its_consumer_as_a_read_only_view_of_what_jax_handed_over(dtype):
    value = (np.arange(LARGE) % 7).astype(dtype).reshape(-1, 8)
    got = tapped_on_the_callback_transport(value)
    assert not got.flags.writeable and got.dtype == value.dtype and got.shape == value.shape
    np.testing.assert_array_equal(got, value)
    owner = memory_owner(got)
    assert isinstance(owner, np.ndarray) and owner.flags.owndata and owner.nbytes == value.nbytes
    assert handover._taps == {}


def test_a_small_tap_is_copied_into_its_record():
    got = tapped_on_the_callback_transport(np.arange(4.0, dtype=np.float32))
    np.testing.assert_array_equal(got, np.arange(4.0))
    assert not isinstance(memory_owner(got), np.ndarray)  # the record's memory


def test_a_handed_over_tap_queues_a_ticket_and_the_receiver_gets_the_array_itself():
    device = fresh_queue()
    array = np.arange(LARGE, dtype=np.uint8)
    handover.enqueue_tap(device, 7, [array], TEST_PLATFORM)
    (record,) = drained(device)
    assert record[FLAGS] == wire.FLAG_HANDED_OVER_IN_PYTHON
    (record,) = handover.with_tap_arrays([record])
    (got,) = record[LEAVES]
    assert np.shares_memory(got, array) and not got.flags.writeable
    assert handover._taps == {}


def test_the_queue_budget_counts_the_arrays_a_handed_over_tap_stands_for():
    device = fresh_queue()
    handover.enqueue_tap(device, 7, [np.zeros(LARGE, np.uint8)], TEST_PLATFORM)
    stats = outfeed.stats(device, platform=TEST_PLATFORM)
    assert LARGE < stats["bytes_queued"] < LARGE + 1024  # the arrays and the ticket's record
    handover.with_tap_arrays(drained(device))
    assert outfeed.stats(device, platform=TEST_PLATFORM)["bytes_queued"] == 0


def assert_copied_into_the_record(device: int, arrays: list) -> None:
    """Taps ``arrays`` through handover.enqueue_tap; checks that its record holds copies of them."""
    handover.enqueue_tap(device, 7, arrays, TEST_PLATFORM)
    (record,) = drained(device)
    assert record[FLAGS] == 0
    assert handover._taps == {}
    for leaf, array in zip(record[LEAVES], arrays, strict=True):
        np.testing.assert_array_equal(leaf, array)
        assert not np.shares_memory(leaf, array)


def test_a_large_array_over_memory_it_does_not_own_is_copied():
    buffer = bytearray(LARGE)  # as under an XLA or jax.Array buffer: memory numpy does not own
    assert_copied_into_the_record(fresh_queue(), [np.frombuffer(buffer, np.uint8)])


def test_a_large_part_of_a_larger_array_is_copied():
    whole = np.arange(4 * LARGE, dtype=np.uint8)  # handed over, it would keep all 4 alive
    assert_copied_into_the_record(fresh_queue(), [whole[:LARGE]])


def test_a_tap_of_owned_and_not_owned_arrays_is_copied_whole():
    assert_copied_into_the_record(fresh_queue(), [np.zeros(LARGE, np.uint8),
                                                  np.frombuffer(bytearray(LARGE), np.uint8)])


def test_a_handed_over_tap_on_a_failed_queue_raises_the_reason_and_leaves_nothing_behind():
    device = fresh_queue()
    outfeed.fail(device, "its receiver died", platform=TEST_PLATFORM)
    with pytest.raises(RuntimeError, match="its receiver died"):
        handover.enqueue_tap(device, 7, [np.zeros(LARGE, np.uint8)], TEST_PLATFORM)
    assert handover._taps == {}


@pytest.mark.timeout(120)
def test_large_taps_behind_a_slow_consumer_make_the_device_wait_within_the_budget():
    budget = 4 * LARGE
    values = []

    def slow(value, _):
        time.sleep(0.01)
        values.append(int(value[0]))

    step = jax.jit(lambda x: hcb.id_tap(slow, x))
    device = jax.local_devices()[0]
    # Delivered asynchronously: each step would otherwise end only once its tap was handled.
    with hcb.config.override(transport="callback", max_queue_bytes=budget, delivery="async"):
        step(jnp.zeros(LARGE // 4, jnp.float32))
        hcb.barrier_wait()
        values.clear()
        hcb.reset_peak_bytes_queued()
        waits_before = hcb.queue_stats()[device]["waits"]
        for i in range(40):
            step(jnp.full(LARGE // 4, i, jnp.float32))
        hcb.barrier_wait()
        stats = hcb.queue_stats()[device]
    assert values == list(range(40))
    # The queue filled up with what the tickets stand for (not their small records) and no more.
    assert 2 * LARGE <= stats["peak_bytes_queued"] <= budget
    assert stats["waits"] > waits_before
    assert handover._taps == {}


@pytest.mark.needs_internals("the callback transport's own host callback")
def test_a_sink_writes_the_arrays_a_large_tap_handed_over(tmp_path):
    from hostcallback.consumer import FileSink, SinkTap, read_records

    sink = FileSink(tmp_path / "large.hcbs")
    value = np.arange(LARGE // 4, dtype=np.float32)
    with hcb.config.override(transport="callback"):
        step = jax.jit(lambda x, i: hcb.id_tap(SinkTap([sink], "big"), {"step": i, "x": x}))
        for i in range(3):
            step(value + i, i)
        hcb.barrier_wait()
    sink.close()
    records = list(read_records(tmp_path / "large.hcbs"))
    assert [r.step for r in records] == [0, 1, 2]
    for i, record in enumerate(records):
        np.testing.assert_array_equal(record.value["x"], value + i)


@pytest.mark.needs_internals("partitioned=True")
def test_partitioned_large_taps_hand_each_device_its_own_shard():
    seen = {}
    mesh = jax.make_mesh((4,), ("d",))
    whole = np.arange(LARGE, dtype=np.float32)  # 4 shards of LARGE bytes each
    x = jax.device_put(whole, NamedSharding(mesh, P("d")))

    def keep(shard, transforms, device):
        ((_, info),) = transforms
        ((offset,),) = info["offset"]  # of the one leaf, in its one dimension
        seen[device.id] = (offset, shard)

    with hcb.config.override(transport="callback"):
        jax.jit(lambda v: hcb.id_tap(keep, v, tap_with_device=True, partitioned=True))(x)
        hcb.barrier_wait()
    assert len(seen) == 4
    for offset, shard in seen.values():
        np.testing.assert_array_equal(shard, whole[offset:offset + len(shard)])
        assert isinstance(memory_owner(shard), np.ndarray)  # handed over, not a record's copy
    assert handover._taps == {}
