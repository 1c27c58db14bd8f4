"""The C++ core's calls: the response tables, timeouts, and a failed queue.

These drive queues of a platform no receiver drains, so each test owns its queue and answers its
calls itself.
"""

import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from helpers import TEST_PLATFORM, drain_one, fresh_queue, run_python, wait_until
from hostcallback import config
from hostcallback._native import outfeed
from hostcallback._records import wire

leaf = wire.as_leaf


def answer_calls(device, answer):
    """Drains call records of one test queue and answers each with ``answer(value)``."""
    raw = drain_one(device)
    record = wire.decode_record(raw)
    assert record.expects_response
    outfeed.respond(device, record.sequence, [answer(record.arrays[0]).reshape(-1).view(np.uint8)],
                    platform=TEST_PLATFORM)
    return record.sequence


def call_in_thread(device, value, timeout_s):
    out = {}

    def run():
        try:
            out["answer"] = outfeed.call_host(device, 3, [leaf(np.int32(value))], timeout_s,
                                         platform=TEST_PLATFORM)
        except Exception as error:  # noqa: BLE001 - the test checks it
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def response_tables(device):
    stats = outfeed.stats(device, platform=TEST_PLATFORM)
    return stats["calls_waiting"], stats["answers_unclaimed"]


@pytest.mark.timeout(60)
def test_an_answered_call_leaves_the_response_tables_empty():
    device = fresh_queue()
    thread, out = call_in_thread(device, 20, 30.0)
    wait_until(lambda: outfeed.stats(device, platform=TEST_PLATFORM)["records_enqueued"] == 1)
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
    wait_until(lambda: response_tables(device) == (1, 0))
    outfeed.fail(device, "the receiver died: because of a test", platform=TEST_PLATFORM)
    thread.join(30)
    assert "because of a test" in str(out["error"])
    assert response_tables(device) == (0, 0)
    with pytest.raises(RuntimeError, match="because of a test"):
        outfeed.enqueue(device, 1, [leaf(np.int32(1))], platform=TEST_PLATFORM)


@pytest.mark.timeout(60)
def test_an_infinite_timeout_waits_until_the_answer_comes():
    device = fresh_queue()
    thread, out = call_in_thread(device, 4, math.inf)
    wait_until(lambda: response_tables(device) == (1, 0))
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
        outfeed.drain_raw(fresh_queue(), 1, 1, timeout, platform=TEST_PLATFORM)
    with pytest.raises(ValueError, match="timeout"):
        outfeed.call_host(fresh_queue(), 1, [], timeout, platform=TEST_PLATFORM)


@pytest.mark.timeout(60)
def test_a_call_times_out_while_its_queue_stays_full_and_the_line_moves_on():
    device = fresh_queue()
    stats = lambda: outfeed.stats(device, platform=TEST_PLATFORM)
    errors = []

    def call():
        try:
            outfeed.call_host(device, 5, [leaf(np.int32(1))], 0.5, platform=TEST_PLATFORM)
        except RuntimeError as error:
            errors.append(str(error))

    with config.override(max_queue_bytes=64 << 10):
        outfeed.enqueue(device, 1, [leaf(np.zeros(80 << 10, np.uint8))],  # full
                        platform=TEST_PLATFORM)
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        wait_until(lambda: stats()["producers_waiting"] == 1)
        behind = threading.Thread(target=outfeed.enqueue, daemon=True, args=(
            device, 1, [leaf(np.full(1000, 7, np.uint8))]), kwargs={"platform": TEST_PLATFORM})
        behind.start()  # waits for room, behind the call in line
        wait_until(lambda: stats()["producers_waiting"] == 2)
        caller.join(30)
        assert len(errors) == 1 and "within its timeout of 0.5" in errors[0]
        assert "queue stayed full" in errors[0]
        outfeed.drain_raw(device, 1, 1 << 30, 5.0, platform=TEST_PLATFORM)  # room again
        (raw,) = outfeed.drain_raw(device, 10, 1 << 30, 5.0, platform=TEST_PLATFORM)
        behind.join(30)
    assert wire.decode_record(raw).arrays[0][0] == 7  # not stuck behind the call that gave up
    assert stats()["calls_waiting"] == 0 and stats()["producers_waiting"] == 0


@pytest.mark.timeout(120)
def test_interrupting_calls_at_exit_ends_a_call_waiting_for_room_in_a_full_queue():
    # In a process of its own: interrupting calls (exit after a Ctrl-C) is for good.
    result = run_python("""
        import sys, threading, time
        import numpy as np
        from hostcallback import config
        from hostcallback._native import outfeed
        from hostcallback._records import wire
        failed = []

        def call():
            try:
                outfeed.call_host(7, 5, [wire.as_leaf(np.int32(1))], 20.0, platform="test")
            except RuntimeError as error:
                failed.append((time.monotonic(), str(error)))

        with config.override(max_queue_bytes=64 << 10):
            outfeed.enqueue(7, 1, [wire.as_leaf(np.zeros(80 << 10, np.uint8))],  # full
                            platform="test")
            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            while outfeed.stats(7, platform="test")["producers_waiting"] == 0:
                time.sleep(0.01)
            interrupted = time.monotonic()
            outfeed.interrupt_calls()
            caller.join(10)
        print(f"{failed[0][0] - interrupted:.3f} {failed[0][1]}" if failed else "still waiting")
        """, devices=1)
    assert result.returncode == 0, result.stderr
    seconds, message = result.stdout.strip().split(" ", 1)
    assert "interrupted (Ctrl-C) as the program exits" in message
    assert float(seconds) < 2.0


def test_a_shared_calls_failure_is_kept_under_an_id_of_its_own_for_every_transport():
    """One table for both transports' shared calls: the calling device keeps the reason, every
    device's check reads it back by (consumer, id); an id from elsewhere reads as such."""
    first = outfeed.keep_call_failure(5, "the call function raised")
    second = outfeed.keep_call_failure(5, "it timed out")
    assert 0 not in (first, second) and first != second
    assert outfeed.call_failure_reason(5, first) == "the call function raised"
    assert outfeed.call_failure_reason(5, second) == "it timed out"
    assert outfeed.call_failure_reason(6, first) == outfeed.CALL_FAILED_ELSEWHERE
