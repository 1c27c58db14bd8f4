"""drain() decodes in C++: records as wire.py would decode them, markers apart, memory released.

Most tests drive queues of a platform no receiver drains, so each owns its queue; the last ones
watch the receivers deliver real taps.
"""

import gc
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from helpers import TEST_PLATFORM, drain_one, fresh_queue, run_python, wait_until
from hostcallback._native import outfeed
from hostcallback._records import wire
from hostcallback._records.registry import BARRIER_MARKER_ID

leaf = wire.as_leaf


def drain(device, max_records=100, max_bytes=1 << 30):
    return outfeed.drain(device, max_records, max_bytes, 5.0, platform=TEST_PLATFORM)


# A host leaf that encodes but cannot be decoded: numpy cannot even make the array.
TOO_MANY_DIMENSIONS = (wire.dtype_code(np.float32), [1] * (wire.MAX_NDIM + 1),
                       np.zeros(4, np.uint8))

ARRAY_SETS = [
    [np.float32(1.5)],
    [np.arange(7, dtype=np.int16).reshape(7, 1), np.zeros((0, 3), np.float64)],
    [np.ones(5, np.bool_), np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
     np.full((2, 2), -1, np.int64), np.arange(4, dtype=np.complex64)],
    [np.arange(40_000, dtype=np.float32)],  # 160 KB: a pooled record with an owner of its own
]


@pytest.mark.parametrize("arrays", ARRAY_SETS)
def test_drain_decodes_a_record_as_the_reference_decoder_does(arrays):
    device = fresh_queue()
    outfeed.enqueue(device, 7, [leaf(a) for a in arrays], platform=TEST_PLATFORM)
    (records, markers) = drain(device)
    assert markers == []
    ((consumer_id, got_device, sequence, flags, got),) = records
    reference = wire.decode_record(wire.encode_record(7, device, 0, arrays))
    assert (consumer_id, got_device, sequence, flags) == (
        reference.consumer_id, reference.device, reference.sequence, reference.flags)
    assert len(got) == len(reference.arrays)
    for mine, theirs in zip(got, reference.arrays):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        np.testing.assert_array_equal(mine, theirs)


def test_records_keep_their_queue_order_and_sequence_numbers():
    device = fresh_queue()
    for i in range(5):
        outfeed.enqueue(device, 3, [leaf(np.int32(i))], platform=TEST_PLATFORM)
    records, _ = drain(device)
    assert [int(r[4][0]) for r in records] == [0, 1, 2, 3, 4]
    assert [r[2] for r in records] == [0, 1, 2, 3, 4]


def test_drained_records_are_left_out_of_the_cycle_collector():
    # Tuples of ints and numpy arrays cannot be part of a cycle; tracked, a receiver's batches
    # set off collections of the whole heap (a fifth of its time).
    device = fresh_queue()
    outfeed.enqueue(device, 3, [leaf(np.int32(1)), leaf(np.ones(3))], platform=TEST_PLATFORM)
    outfeed.enqueue(device, 4, [TOO_MANY_DIMENSIONS], platform=TEST_PLATFORM)
    enabled = gc.isenabled()
    gc.disable()  # a collection would untrack such tuples itself, hiding a drain that did not
    try:
        records, _ = drain(device)
        decoded, undecodable = records
        assert type(decoded[4]) is tuple and len(decoded[4]) == 2
        assert isinstance(undecodable[4], str)
        for record in records:
            assert not gc.is_tracked(record)
            assert not gc.is_tracked(record[4])
    finally:
        if enabled:
            gc.enable()


def enqueue_values(device, *values):
    for value in values:
        outfeed.enqueue(device, 3, [leaf(np.int32(value))], platform=TEST_PLATFORM)


def drained_values(device, max_records):
    records, _ = drain(device, max_records)
    return [int(r[4][0]) for r in records]


def test_queue_order_holds_when_the_queue_grows_while_wrapped_around():
    device = fresh_queue()
    enqueue_values(device, *range(50))
    assert drained_values(device, 30) == list(range(30))  # the oldest record is mid-queue
    enqueue_values(device, *range(50, 200))  # wraps around, then grows
    assert drained_values(device, 1000) == list(range(30, 200))


def test_queue_order_holds_after_a_large_backlog_is_drained_and_a_new_one_queued():
    device = fresh_queue()
    backlog = 70_000  # more than a queue keeps room for once it is empty
    for _ in range(2):
        enqueue_values(device, *range(backlog))
        got = []
        while len(got) < backlog:
            got += drained_values(device, 4096)
        assert got == list(range(backlog))


def test_barrier_markers_come_back_apart_and_never_as_records():
    device = fresh_queue()
    outfeed.enqueue(device, 3, [leaf(np.int32(1))], platform=TEST_PLATFORM)
    outfeed.enqueue(device, BARRIER_MARKER_ID, [leaf(np.uint64(42))], platform=TEST_PLATFORM)
    enqueue_values(device, 2)
    records, markers = drain(device)
    assert markers == [42]
    assert [int(r[4][0]) for r in records] == [1, 2]


def test_decoded_arrays_are_read_only_and_cannot_be_made_writable():
    device = fresh_queue()
    outfeed.enqueue(device, 3, [leaf(np.arange(4, dtype=np.int32))], platform=TEST_PLATFORM)
    ((*_, (array,)),), _ = drain(device)
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0] = 9
    with pytest.raises(ValueError):
        array.flags.writeable = True


def test_drained_records_are_read_only_and_cannot_be_made_writable():
    device = fresh_queue()
    outfeed.enqueue(device, 1, [leaf(np.arange(4, dtype=np.int32))], platform=TEST_PLATFORM)
    raw = drain_one(device)
    assert not raw.flags.writeable
    with pytest.raises(ValueError):
        raw[40] = 0  # the record-size field a writable array let consumers change
    with pytest.raises(ValueError):
        raw.flags.writeable = True


def test_keeping_one_array_keeps_only_its_own_record_not_its_batch():
    device = fresh_queue()
    held = outfeed.pool_stats()["records_held"]
    outfeed.enqueue(device, 3, [leaf(np.float32(1.5))], platform=TEST_PLATFORM)
    for _ in range(15):  # 60 KB each: below the pool, so once they shared the batch's owner
        outfeed.enqueue(device, 3, [leaf(np.zeros(15_000, np.float32))], platform=TEST_PLATFORM)
    records, _ = drain(device)
    assert outfeed.pool_stats()["records_held"] == held + 16
    kept = records[0][4][0]  # what `losses.append(loss)` in a consumer does
    del records
    assert outfeed.pool_stats()["records_held"] == held + 1
    assert float(kept) == 1.5
    del kept
    assert outfeed.pool_stats()["records_held"] == held


def test_a_record_that_cannot_be_decoded_fails_alone_and_its_batch_and_markers_survive():
    device = fresh_queue()
    outfeed.enqueue(device, 3, [leaf(np.int32(1))], platform=TEST_PLATFORM)
    outfeed.enqueue(device, 4, [TOO_MANY_DIMENSIONS], platform=TEST_PLATFORM)
    outfeed.enqueue(device, BARRIER_MARKER_ID, [leaf(np.uint64(42))], platform=TEST_PLATFORM)
    enqueue_values(device, 2)
    records, markers = drain(device)
    assert markers == [42]
    assert [r[0] for r in records] == [3, 4, 3]
    assert int(records[0][4][0]) == 1 and int(records[2][4][0]) == 2
    assert isinstance(records[1][4], str) and "dimension" in records[1][4]


@pytest.mark.parametrize("dims,nbytes", [([1 << 26], 4), ([-1], 4), ([3], 16), ([1 << 62, 8], 0)])
def test_a_host_leaf_whose_bytes_do_not_match_its_shape_is_refused(dims, nbytes):
    device = fresh_queue()
    code = wire.dtype_code(np.float32)
    with pytest.raises(ValueError, match="do not match its shape"):
        outfeed.enqueue(device, 3, [(code, dims, np.zeros(nbytes, np.uint8))],
                        platform=TEST_PLATFORM)
    assert outfeed.stats(device, platform=TEST_PLATFORM)["records_enqueued"] == 0


def test_a_host_leaf_of_an_unknown_dtype_code_is_refused():
    with pytest.raises(ValueError, match="unknown wire dtype code 250"):
        outfeed.enqueue(fresh_queue(), 3, [(250, [1], np.zeros(4, np.uint8))],
                        platform=TEST_PLATFORM)


def test_a_large_record_goes_back_to_the_pool_as_soon_as_its_arrays_are_dropped():
    device = fresh_queue()
    big = np.ones(1 << 18, np.float32)  # 1 MiB
    outfeed.enqueue(device, 3, [leaf(big)], platform=TEST_PLATFORM)
    outfeed.enqueue(device, 3, [leaf(np.int32(0))], platform=TEST_PLATFORM)
    records, _ = drain(device)
    large = records[0][4][0]
    del records  # the small record goes back; the large one is still viewed: still in use
    held = outfeed.pool_stats()["in_use_bytes"]
    np.testing.assert_array_equal(large, big)
    del large
    assert outfeed.pool_stats()["in_use_bytes"] <= held - big.nbytes


def test_a_pooled_buffer_is_reused_for_a_record_of_the_same_size_class():
    device = fresh_queue()
    for size in (300_000, 310_000):  # different sizes, one class
        outfeed.enqueue(device, 3, [leaf(np.zeros(size // 4, np.float32))], platform=TEST_PLATFORM)
        records, _ = drain(device)
        del records
    before = outfeed.pool_stats()
    outfeed.enqueue(device, 3, [leaf(np.zeros(305_000 // 4, np.float32))], platform=TEST_PLATFORM)
    after = outfeed.pool_stats()
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"]
    drain(device)


_POOL_SCRIPT = """
import numpy as np
from hostcallback import config
from hostcallback._records import wire
from hostcallback._native import outfeed

def drain():  # as the receivers drain
    return outfeed.drain(0, 1024, 1 << 20, 5.0, platform="decoded")[0]

def enqueue(value):
    outfeed.enqueue(0, 3, [wire.as_leaf(value)], platform="decoded")

def small_round_trips(count):
    \"\"\"With one small buffer back in the pool, `count` small records each enqueued and drained
    in turn; prints the pool hits and misses they took.\"\"\"
    enqueue(np.int32(0))
    drain()  # its buffer is back in the pool
    before = outfeed.pool_stats()
    for value in range(count):
        enqueue(np.int32(value))
        assert int(drain()[0][4][0]) == value
    after = outfeed.pool_stats()
    print(after["hits"] - before["hits"], after["misses"] - before["misses"])

"""


_RECEIVER_THREAD = """
import threading

def receiver_thread(count, drains_again):
    \"\"\"A thread that drains `count` records and drops them, drains once more if told, and
    stays alive until its returned event is set.\"\"\"
    done, finish = threading.Event(), threading.Event()
    def run():
        assert len(drain()) == count  # the batch is dropped at once
        if drains_again:
            outfeed.drain(0, 1024, 1 << 20, 0.001, platform="decoded")
        done.set()
        finish.wait(60)
    thread = threading.Thread(target=run)
    thread.start()
    assert done.wait(60)
    return thread, finish

def enqueue_many(count):
    for value in range(count):
        enqueue(np.int32(value))

def enqueue_counting(count):
    \"\"\"Enqueues `count` records and prints the pool hits and misses they took.\"\"\"
    before = outfeed.pool_stats()
    enqueue_many(count)
    after = outfeed.pool_stats()
    print(after["hits"] - before["hits"], after["misses"] - before["misses"])

"""


def pool_hits_and_misses(body: str, setup: str = "") -> list[str]:
    """Runs ``body`` after _POOL_SCRIPT and ``setup`` in a fresh process (the pool is shared by
    every queue, and earlier tests leave it full); it prints the hits and misses it counted."""
    result = run_python(_POOL_SCRIPT + setup + textwrap.dedent(body), devices=1)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_small_records_reuse_pooled_buffers_instead_of_allocating():
    assert pool_hits_and_misses("small_round_trips(100)") == ["100", "0"]


def test_a_receivers_released_records_reach_the_pool_when_its_next_drain_begins():
    assert pool_hits_and_misses(setup=_RECEIVER_THREAD, body="""
        enqueue_many(10)  # this thread never drains: only the receiver's releases count
        thread, finish = receiver_thread(10, drains_again=True)
        enqueue_counting(10)
        finish.set()
    """) == ["10", "0"]


def test_a_receiver_that_does_not_drain_again_still_returns_its_records_64_at_a_time():
    assert pool_hits_and_misses(setup=_RECEIVER_THREAD, body="""
        enqueue_many(100)
        thread, finish = receiver_thread(100, drains_again=False)
        enqueue_counting(100)
        finish.set()
    """) == ["64", "36"]


def test_a_receiver_thread_that_ends_returns_the_records_it_released():
    assert pool_hits_and_misses(setup=_RECEIVER_THREAD, body="""
        import time
        enqueue_many(10)
        thread, finish = receiver_thread(10, drains_again=False)
        pooled = outfeed.pool_stats()["pooled_bytes"]
        finish.set()
        thread.join(60)  # returns before the thread's C++ thread-locals are destroyed, so:
        deadline = time.monotonic() + 10
        while outfeed.pool_stats()["pooled_bytes"] == pooled and time.monotonic() < deadline:
            time.sleep(0.01)
        enqueue_counting(10)
    """) == ["10", "0"]


def test_a_backlog_of_small_records_leaves_the_pool_room_for_large_ones():
    assert pool_hits_and_misses("""
        config.configure(max_queue_bytes=4 << 20)
        for value in range(32_000):  # a backlog of almost the whole budget of small records
            enqueue(np.int32(value))
        while drain():
            pass  # delivered: their buffers go back to the pool, an eighth of it at most
        big = np.ones(1 << 18, np.float32)  # 1 MiB
        enqueue(big)
        drain()
        before = outfeed.pool_stats()
        for _ in range(20):
            enqueue(big)
            drain()
        after = outfeed.pool_stats()
        print(after["hits"] - before["hits"], after["misses"] - before["misses"])
    """) == ["20", "0"]


def test_a_record_larger_than_the_pool_can_keep_does_not_stop_it_keeping_small_ones():
    assert pool_hits_and_misses("""
        config.configure(max_queue_bytes=1 << 20)  # the pool keeps at most 2 MiB
        enqueue(np.ones(1 << 20, np.float32))  # 4 MiB: goes in alone, never pooled
        huge = drain()[0][4][0]  # and a consumer keeps it
        small_round_trips(100)
        assert huge.sum() == 1 << 20
    """) == ["100", "0"]


@pytest.mark.timeout(120)
def test_pool_stats_does_not_deadlock_when_the_garbage_collector_frees_a_record():
    result = run_python("""
        import gc
        import numpy as np
        from hostcallback._records import wire
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


@pytest.mark.parametrize("coalesce_s", [-1.0, float("nan"), 5.0])
def test_a_bad_coalescing_window_is_refused(coalesce_s):
    with pytest.raises(ValueError, match="coalesce_s"):
        outfeed.drain(fresh_queue(), 1, 1, 0.001, platform=TEST_PLATFORM, coalesce_s=coalesce_s)


def test_a_lone_record_comes_out_after_the_coalescing_window_not_never():
    device = fresh_queue()
    outfeed.enqueue(device, 3, [leaf(np.int32(1))], platform=TEST_PLATFORM)
    records, _ = outfeed.drain(device, 100, 1 << 20, 5.0, platform=TEST_PLATFORM, coalesce_s=0.001)
    assert len(records) == 1


@pytest.mark.timeout(60)
def test_a_waiting_drain_gathers_the_records_that_follow_within_its_window():
    device = fresh_queue()
    got = []
    waiting = threading.Thread(target=lambda: got.append(outfeed.drain(
        device, 100, 1 << 20, 10.0, platform=TEST_PLATFORM, coalesce_s=1.0)))
    waiting.start()
    time.sleep(0.2)  # the drain waits on the empty queue
    enqueue_values(device, 1)  # wakes it: window opens
    time.sleep(0.1)
    enqueue_values(device, 2)
    waiting.join(30)
    ((records, _),) = got
    assert [int(r[4][0]) for r in records] == [1, 2]  # one batch, not two wake-ups


@pytest.mark.timeout(60)
def test_stats_count_a_drain_as_waiting_until_a_record_ends_its_wait():
    device = fresh_queue()
    got = []
    waiting = threading.Thread(target=lambda: got.append(drain(device, max_records=1)))
    waiting.start()
    wait_until(lambda: outfeed.stats(device, platform=TEST_PLATFORM)["receivers_waiting"] == 1,
               what="the drain to wait")
    enqueue_values(device, 1)
    assert batch_taken(waiting, got) == ([1], [])
    assert outfeed.stats(device, platform=TEST_PLATFORM)["receivers_waiting"] == 0


@pytest.mark.parametrize("linger_s", [-1.0, float("nan"), 5.0])
def test_a_bad_linger_window_is_refused(linger_s):
    with pytest.raises(ValueError, match="linger_s"):
        outfeed.drain(fresh_queue(), 1, 1, 0.001, platform=TEST_PLATFORM, linger_s=linger_s)


def drain_in_background(device, **windows) -> tuple[threading.Thread, list]:
    """A drain waiting on the empty queue (as a receiver's does), and where its batch will go."""
    got: list = []
    waiting = threading.Thread(target=lambda: got.append(outfeed.drain(
        device, 100, 1 << 20, 10.0, platform=TEST_PLATFORM, **windows)))
    waiting.start()
    time.sleep(0.2)
    return waiting, got


def batch_taken(waiting, got) -> tuple[list[int], list[int]]:
    """The values of the records (and the markers) that a background drain returned."""
    waiting.join(30)
    ((records, markers),) = got
    return [int(r[4][0]) for r in records], markers


def wakeups(device) -> int:
    return outfeed.stats(device, platform=TEST_PLATFORM)["receiver_wakeups"]


def woken_by(device, send) -> None:
    """Runs send(), which enqueues what a drain already waiting on the empty queue is woken for
    (a wake-up call proves it was waiting, so that what it does next follows from its window)."""
    before = wakeups(device)
    send()
    assert wakeups(device) == before + 1


def woken_with(device, *values) -> None:
    woken_by(device, lambda: enqueue_values(device, *values))


def queue_after_a_window_that_gathered_nothing() -> int:
    """A queue whose last coalescing window (0.5 s) waited for more records in vain."""
    device = fresh_queue()
    waiting, got = drain_in_background(device, coalesce_s=0.5)
    woken_with(device, 0)
    assert batch_taken(waiting, got)[0] == [0]
    return device


@pytest.mark.timeout(60)
def test_after_a_window_that_gathered_nothing_a_lone_record_is_not_held_back():
    device = queue_after_a_window_that_gathered_nothing()
    waiting, got = drain_in_background(device, coalesce_s=0.5)
    woken_with(device, 1)  # handed out at once: a slow stream pays no second wake-up
    time.sleep(0.3)
    enqueue_values(device, 2)
    assert batch_taken(waiting, got)[0] == [1]


@pytest.mark.timeout(60)
def test_one_record_found_queued_leaves_the_coalescing_window_off():
    device = queue_after_a_window_that_gathered_nothing()
    enqueue_values(device, 1)
    assert drained_values(device, 100) == [1]
    waiting, got = drain_in_background(device, coalesce_s=0.5)
    woken_with(device, 2)
    time.sleep(0.3)
    enqueue_values(device, 3)
    assert batch_taken(waiting, got)[0] == [2]


def gathers_the_next_two(device) -> bool:
    """Whether a waiting drain's coalescing window (0.5 s) gathers a record 0.2 s after the one
    that woke it."""
    waiting, got = drain_in_background(device, coalesce_s=0.5)
    woken_with(device, 3)
    time.sleep(0.2)
    enqueue_values(device, 4)
    return batch_taken(waiting, got)[0] == [3, 4]


@pytest.mark.timeout(60)
def test_a_burst_brings_the_coalescing_window_back():
    device = queue_after_a_window_that_gathered_nothing()
    enqueue_values(device, 1, 2)  # a burst: found queued together
    assert drained_values(device, 100) == [1, 2]
    assert gathers_the_next_two(device)


@pytest.mark.timeout(60)
def test_a_lone_barrier_marker_does_not_turn_the_coalescing_window_off():
    device = fresh_queue()
    waiting, got = drain_in_background(device, coalesce_s=0.5)
    woken_by(device, lambda: outfeed.enqueue(device, BARRIER_MARKER_ID, [leaf(np.uint64(7))],
                                             platform=TEST_PLATFORM))
    assert batch_taken(waiting, got) == ([], [7])  # handed out at once, no window
    assert gathers_the_next_two(device)


def streaming_queue() -> int:
    """A queue whose last drain handed out a batch: its records are flowing."""
    device = fresh_queue()
    enqueue_values(device, 0)
    assert len(drain(device)[0]) == 1
    return device


@pytest.mark.timeout(60)
def test_after_a_batch_a_drain_lingers_for_the_records_that_follow_unwoken():
    device = streaming_queue()
    waiting, got = drain_in_background(device, linger_s=1.0)
    before = wakeups(device)
    enqueue_values(device, 1)  # does not wake it (no coalescing window: it would return alone)
    time.sleep(0.1)
    enqueue_values(device, 2)
    assert wakeups(device) == before  # and no wake-up call was made for them
    assert batch_taken(waiting, got)[0] == [1, 2]


@pytest.mark.timeout(60)
def test_a_stream_slower_than_the_window_is_not_lingered_for():
    device = streaming_queue()
    waiting, got = drain_in_background(device, linger_s=0.05)
    enqueue_values(device, 1)  # came after the window: the stream is slower than it
    waiting.join(30)
    waiting, got = drain_in_background(device, linger_s=1.0)
    before = wakeups(device)
    enqueue_values(device, 2)  # wakes it at once, as after a quiet spell
    time.sleep(0.3)
    enqueue_values(device, 3)
    assert batch_taken(waiting, got)[0] == [2]
    assert wakeups(device) > before


@pytest.mark.timeout(60)
def test_after_an_empty_drain_the_first_record_wakes_the_next_at_once():
    device = streaming_queue()
    assert outfeed.drain(device, 100, 1 << 20, 0.05, platform=TEST_PLATFORM,
                         linger_s=0.01) == ([], [])  # the stream went quiet
    waiting, got = drain_in_background(device, linger_s=1.0)
    enqueue_values(device, 1)  # wakes it: it returns before the next one comes
    time.sleep(0.3)
    enqueue_values(device, 2)
    assert batch_taken(waiting, got)[0] == [1]


@pytest.mark.timeout(60)
def test_a_barrier_marker_ends_a_linger_at_once():
    device = streaming_queue()
    waiting, got = drain_in_background(device, linger_s=1.0)
    enqueue_values(device, 1)
    outfeed.enqueue(device, BARRIER_MARKER_ID, [leaf(np.uint64(42))],
                    platform=TEST_PLATFORM)  # wakes it
    time.sleep(0.3)
    enqueue_values(device, 2)
    assert batch_taken(waiting, got) == ([1], [42])


@pytest.mark.timeout(60)
def test_a_lone_tap_is_delivered_without_a_barrier():
    delivered = threading.Event()
    jax.jit(lambda x: hcb.id_tap(lambda arg, transforms: delivered.set(), x))(jnp.int32(1))
    assert delivered.wait(timeout=30)  # generous: the behaviour, not its speed (bench/)


@pytest.mark.timeout(120)
def test_under_load_a_receiver_takes_records_in_batches():
    seen = []
    before = hcb.queue_stats()[jax.devices()[0]]
    jax.jit(lambda x: lax.fori_loop(0, 20_000, lambda i, c: hcb.id_tap(
        lambda arg, transforms: seen.append(int(arg)), c + 1), x))(jnp.int32(0))
    hcb.barrier_wait()
    after = hcb.queue_stats()[jax.devices()[0]]
    assert seen == list(range(1, 20_001))
    records = after["records_delivered"] - before["records_delivered"]
    batches = after["batches"] - before["batches"]
    assert batches * 4 <= records, (batches, records)


@pytest.mark.timeout(60)
def test_a_consumer_asking_for_its_record_gets_device_and_sequence():
    got = []

    def consumer(arg, transforms):
        record = hcb.current_record()
        got.append((record.device, record.sequence, int(arg)))

    jax.jit(lambda x: hcb.id_tap(consumer, x))(jnp.int32(5))
    hcb.barrier_wait()
    ((device, sequence, value),) = got
    assert device == jax.devices()[0] and value == 5 and isinstance(sequence, int)
    assert hcb.current_record() is None
