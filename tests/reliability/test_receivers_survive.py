"""Receivers survive anything a consumer or drain() raises; if one dies anyway, nothing waits
for it forever; failures are logged without flooding; a failed call is reported once."""

import logging
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import pytest
from helpers import run_python

import hostcallback as hcb
from hostcallback import wire
from hostcallback._native import outfeed


class Stop(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", [SystemExit(3), Stop("out of the blue"), GeneratorExit()],
                         ids=["SystemExit", "BaseException", "GeneratorExit"])
def test_a_consumer_raising_a_base_exception_is_reported_and_the_receiver_lives(
        transport, collector, error):
    def quits(arg, transforms):
        raise error

    jax.jit(lambda x: hcb.id_tap(quits, x))(1)
    with pytest.raises(hcb.CallbackException) as info:
        hcb.barrier_wait(timeout=60)
    assert info.value.__cause__ is error
    jax.jit(lambda x: hcb.id_tap(collector, x))(2)  # the same device's receiver still runs
    hcb.barrier_wait(timeout=60)
    assert collector.values == [2]


@pytest.mark.timeout(120)
def test_an_error_out_of_drain_is_reported_and_the_receiver_goes_on(
        transport, collector, monkeypatch):
    real_drain, lock, failures = outfeed.drain, threading.Lock(), []

    def drain_failing_once(*args, **kwargs):
        with lock:
            fail = not failures
            failures.append(1)
        if fail:
            raise MemoryError("drain could not allocate")
        return real_drain(*args, **kwargs)

    monkeypatch.setattr(outfeed, "drain", drain_failing_once)
    jax.jit(lambda x: hcb.id_tap(collector, x))(5)
    with pytest.raises(hcb.CallbackException) as info:
        hcb.barrier_wait(timeout=60)
    assert isinstance(info.value.__cause__, MemoryError)
    assert collector.values == [5]
    hcb.barrier_wait(timeout=60)  # reported once


@pytest.mark.timeout(120)
def test_a_record_the_core_could_not_decode_fails_only_its_own_consumer(
        transport, collector, monkeypatch):
    real_drain = outfeed.drain

    def drain_failing_to_decode_ones(*args, **kwargs):  # as drain() says why, in place of arrays
        records, markers = real_drain(*args, **kwargs)
        return [(*r[:4], "an array of 65 dimensions") if int(r[4][0]) == 1 else r
                for r in records], markers

    monkeypatch.setattr(outfeed, "drain", drain_failing_to_decode_ones)
    hcb.barrier_wait(timeout=60)  # every receiver's drain() in progress has returned
    tap = jax.jit(lambda x: hcb.id_tap(collector, x))
    tap(1)
    tap(2)
    with pytest.raises(hcb.CallbackException) as info:
        hcb.barrier_wait(timeout=60)
    assert isinstance(info.value.__cause__, wire.UndecodableRecordError)
    assert "65 dimensions" in str(info.value.__cause__)
    assert collector.values == [2]


@pytest.mark.timeout(120)
def test_a_kept_consumer_failure_does_not_keep_its_records_alive(transport):
    def fails(arg, transforms):
        raise ValueError("no")

    held = outfeed.pool_stats()["records_held"]
    jax.jit(lambda x: hcb.id_tap(fails, x))(jnp.zeros(1 << 16, jnp.float32))
    with pytest.raises(hcb.CallbackException) as info:
        hcb.barrier_wait(timeout=60)
    deadline = time.monotonic() + 10
    while outfeed.pool_stats()["records_held"] > held:  # the receiver lets go of its batch
        assert time.monotonic() < deadline, "a failure kept its 256 KiB record alive"
        time.sleep(0.01)
    where = "".join(traceback.format_tb(info.value.__cause__.__traceback__))
    assert "in fails" in where and 'raise ValueError("no")' in where  # still says where


def test_a_keyboard_interrupt_in_a_consumer_reaches_the_main_thread():
    result = run_python("""
        import signal, time
        # A run started as a background job (nohup, many CI runners) inherits SIGINT ignored, and
        # then Python installs no handler: what Ctrl-C would do is set up here.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import jax
        import hostcallback as hcb
        seen = []
        def interrupted(arg, transforms):
            if int(arg) == 1:
                raise KeyboardInterrupt
            seen.append(int(arg))
        tap = jax.jit(lambda x: hcb.id_tap(interrupted, x))
        try:
            tap(1)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.01)
            print("no interrupt")
        except KeyboardInterrupt:
            print("main thread interrupted")
        tap(2)
        hcb.barrier_wait(timeout=60)  # the receiver lives; the interrupt is not reported twice
        print(seen)
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["main thread interrupted", "[2]"], result.stderr


@pytest.mark.parametrize("transport", ["native", "callback"])
def test_if_a_receiver_dies_anyway_calls_and_barriers_fail_naming_why(transport):
    result = run_python("""
        import jax
        import numpy as np
        import hostcallback as hcb
        from hostcallback.lifecycle import lifecycle
        from hostcallback.receiver import receivers

        class Broken(BaseException):
            pass

        def deliver(*args):  # a fault inside the receiver itself, outside any consumer
            raise Broken("injected fault")

        lifecycle.ensure_started()
        receivers._deliver = deliver
        for attempt in ("tap", "call", "barrier", "barrier again"):
            try:
                if attempt == "tap":  # its computation ends only once its tap was handled
                    jax.jit(lambda x: hcb.id_tap(lambda a, t: None, x))(1).block_until_ready()
                elif attempt == "call":
                    jax.jit(lambda x: hcb.call(lambda v: v, x, result_shape=x))(
                        np.float32(1)).block_until_ready()
                else:
                    hcb.barrier_wait(timeout=60)
                print(attempt, "returned")
            except Exception as error:
                print(attempt, "failed:", type(error).__name__, "died" in str(error),
                      "injected fault" in str(error))
        """, env={"HOSTCALLBACK_TRANSPORT": transport, "HOSTCALLBACK_EXIT_TIMEOUT": "5"})
    lines = result.stdout.split("\n")
    assert lines[0].startswith("tap failed:") and lines[0].endswith("True True"), result.stderr
    assert lines[1].startswith("call failed:") and lines[1].endswith("True True"), result.stderr
    assert lines[2] == "barrier failed: CallbackException True True", result.stderr
    assert lines[3] == "barrier again failed: CallbackException True True", result.stderr


def test_a_hundred_failing_taps_log_one_traceback_and_a_count():
    result = run_python("""
        import jax
        from jax import lax
        import hostcallback as hcb
        def broken(arg, transforms):
            raise ValueError(f"bad {int(arg)}")
        jax.jit(lambda x: lax.fori_loop(0, 100, lambda i, c: hcb.id_tap(broken, i), x))(0)
        try:
            hcb.barrier_wait()
        except hcb.CallbackException as error:
            print(error)
        """, devices=1)
    assert result.returncode == 0, result.stderr
    assert "100 tap consumer call(s) raised since the last barrier_wait" in result.stdout
    assert result.stderr.count("Traceback") == 1, result.stderr
    counts = [int(line.split(" raised ")[1].split(" more")[0])
              for line in result.stderr.splitlines() if "more time(s)" in line]
    assert sum(counts) == 99, result.stderr
    assert len(result.stderr.splitlines()) < 40, result.stderr


def test_a_failing_call_is_reported_once_and_logged_as_a_call(transport, caplog):
    def broken(v):
        raise ArithmeticError("no answer")

    with caplog.at_level(logging.ERROR, logger="hostcallback"):
        with pytest.raises(Exception, match="broken failed: ArithmeticError: no answer"):
            jax.jit(lambda x: hcb.call(broken, x, result_shape=x))(
                jnp.float32(1)).block_until_ready()
        hcb.barrier_wait()  # not reported again here
    messages = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert messages and all(m.startswith("hostcallback: call broken") for m in messages)

