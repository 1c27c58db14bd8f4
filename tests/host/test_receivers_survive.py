"""Receivers survive anything a consumer or drain() raises; if one dies anyway, nothing waits
for it forever; failures are logged without flooding; a failed call is reported once."""

import logging
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import pytest

import hostcallback as hcb
from helpers import run_python
from hostcallback import config, errors
from hostcallback._native import outfeed
from hostcallback._records import handover


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


class Unnamable:
    """A callable without ``__name__`` whose repr fails, as a half-built object's may."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def __repr__(self):
        raise RuntimeError("no repr for you")

    def __call__(self, arg, *rest):
        if self.error is not None:
            raise self.error
        return arg


class Unprintable(Exception):
    def __str__(self):
        raise AttributeError("it formats a field it never set")


NOT_UTF8 = b"caf\xe9.txt".decode("utf-8", "surrogateescape")  # as os.listdir gives it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", [ValueError("bad"), Unprintable(),
                                   FileNotFoundError(f"no such file: {NOT_UTF8}")],
                         ids=["repr fails", "str fails", "lone surrogate"])
def test_a_failing_tap_consumer_that_cannot_be_described_leaves_its_receiver_alive(
        transport, collector, error):
    jax.jit(lambda x: hcb.id_tap(Unnamable(error), x))(1)
    with pytest.raises(hcb.CallbackException) as info:
        hcb.barrier_wait(timeout=60)
    assert info.value.__cause__ is error
    assert "<Unnamable object> on " in str(info.value)
    jax.jit(lambda x: hcb.id_tap(collector, x))(2)
    hcb.barrier_wait(timeout=60)
    assert collector.values == [2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error, said", [
    (ValueError("bad"), "ValueError: bad"),
    (Unprintable(), "Unprintable (its message could not be formatted: AttributeError)"),
    (FileNotFoundError(f"no such file: {NOT_UTF8}"), "no such file: caf\\udce9.txt")],
    ids=["repr fails", "str fails", "lone surrogate"])
def test_a_failing_call_that_cannot_be_described_fails_only_itself(transport, error, said):
    calling = jax.jit(lambda f, x: hcb.call(f, x, result_shape=x), static_argnums=0)
    with pytest.raises(Exception, match="hostcallback call consumer") as info:
        calling(Unnamable(error), jnp.float32(1)).block_until_ready()
    assert "<Unnamable object> failed: " in str(info.value)
    assert said in str(info.value)
    assert float(calling(Unnamable(None), jnp.float32(3))) == 3.0  # the receiver lives
    hcb.barrier_wait(timeout=60)  # a failed call is reported by its call, not again here


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
def test_an_error_after_drain_took_a_barriers_markers_ends_that_barrier_with_it(
        transport, collector, monkeypatch):
    jax.jit(lambda x: hcb.id_tap(collector, x))(1)
    hcb.barrier_wait(timeout=60)
    real, failed = handover.with_tap_arrays, []

    def failing_once(batch):  # the drain that brings the next barrier's markers fails after it
        if not failed:
            failed.append(batch)
            raise MemoryError("no memory to hand the batch over")
        return real(batch)

    monkeypatch.setattr(handover, "with_tap_arrays", failing_once)
    with pytest.raises(hcb.CallbackException) as info:
        hcb.barrier_wait(timeout=60)  # not a TimeoutError: its markers were not dropped
    assert isinstance(info.value.__cause__, MemoryError)
    jax.jit(lambda x: hcb.id_tap(collector, x))(2)
    hcb.barrier_wait(timeout=60)
    assert collector.values == [1, 2]


@pytest.mark.timeout(120)
def test_a_batch_whose_hand_over_failed_lets_go_of_the_arrays_its_large_taps_handed_over(
        collector, monkeypatch):
    def failing(batch):
        raise MemoryError("no memory to hand the batch over")

    with config.override(transport="callback"):
        monkeypatch.setattr(handover, "with_tap_arrays", failing)
        jax.jit(lambda x: hcb.id_tap(collector, x))(jnp.ones(1 << 18)).block_until_ready()
        with pytest.raises(hcb.CallbackException):
            hcb.barrier_wait(timeout=60)
        assert handover._taps == {}  # the tap was lost, and its 1 MiB array is not kept
        monkeypatch.undo()
    assert collector.values == []


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
    assert isinstance(info.value.__cause__, errors.UndecodableRecordError)
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
        from hostcallback._host.receiver import receivers

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


def test_a_dead_receiver_lets_go_of_the_arrays_its_queued_large_taps_handed_over():
    result = run_python("""
        import time
        import jax, jax.numpy as jnp
        import hostcallback as hcb
        from hostcallback._records import handover
        from hostcallback.lifecycle import lifecycle
        from hostcallback._host.receiver import receivers

        class Broken(BaseException):
            pass

        def deliver(*args):  # the first batch holds the receiver a while, then kills it
            time.sleep(0.5)
            raise Broken("injected fault")

        hcb.configure(delivery="async")  # the steps do not wait for their taps
        lifecycle.ensure_started()
        receivers._deliver = deliver
        step = jax.jit(lambda x: hcb.id_tap(lambda a, t: None, x) + 1)
        big = jnp.ones(1 << 18)  # 1 MiB: its tap hands the array over instead of copying it
        for _ in range(4):
            big = step(big)
        big.block_until_ready()
        print("queued", len(handover._taps))
        while not receivers.dead:
            time.sleep(0.05)
        print("held after the receiver died", len(handover._taps))
        """, devices=1, env={"HOSTCALLBACK_TRANSPORT": "callback",
                             "HOSTCALLBACK_EXIT_TIMEOUT": "5"})
    lines = result.stdout.splitlines()
    assert lines[0] != "queued 0", result.stderr  # some waited in the queue behind the first
    assert lines[1] == "held after the receiver died 0", result.stderr


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

