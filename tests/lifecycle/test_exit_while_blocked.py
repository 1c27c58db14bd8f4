"""Exit and stop_outfeed_receiver() while a device waits: on a full queue, or for a call's
answer. Each ends within one exit deadline, fails the waiting computation clearly, and never
crashes (global C++ state outlives the interpreter's exit while device threads still run)."""

import re

import pytest

from helpers import run_python

BLOCKED_ON_A_FULL_QUEUE = """
    import threading, time
    import jax, jax.numpy as jnp
    from jax import lax
    import hostcallback as hcb

    hcb.configure(max_queue_bytes=64 * 1024)
    stuck = threading.Event()
    errors = []

    def run():  # 40 records of 16 KiB: the queue holds 4 and the consumer never returns
        try:
            jax.jit(lambda x: lax.fori_loop(
                0, 40, lambda i, c: (hcb.id_tap(lambda a, t: stuck.wait(), c + i), c)[1], x))(
                jnp.zeros(4096, jnp.float32)).block_until_ready()
        except Exception as error:
            errors.append(str(error))

    producer = threading.Thread(target=run, daemon=True)
    producer.start()
    deadline = time.monotonic() + 60
    while hcb.queue_stats()[jax.devices()[0]]["producers_waiting"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    {ending}
    """


@pytest.mark.parametrize("transport", ["native", "callback"])
def test_stop_while_a_device_waits_on_a_full_queue_fails_its_computation_clearly(transport):
    result = run_python(BLOCKED_ON_A_FULL_QUEUE.format(ending="""
    hcb.stop_outfeed_receiver(timeout=2)
    producer.join(60)
    print(not producer.is_alive(), len(errors), "receiver was stopped" in errors[0])
    """), env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True 1 True", result.stderr


@pytest.mark.parametrize("transport", ["native", "callback"])
def test_exit_while_a_device_waits_on_a_full_queue_ends_within_the_exit_timeout(transport):
    result = run_python(BLOCKED_ON_A_FULL_QUEUE.format(ending="print('exiting', flush=True)"),
                        env={"HOSTCALLBACK_TRANSPORT": transport,
                             "HOSTCALLBACK_EXIT_TIMEOUT": "2"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "exiting"
    assert "tap records were not delivered before exit" in result.stderr
    waited = re.search(r"waited ([0-9.]+) s of HOSTCALLBACK_EXIT_TIMEOUT=2 s", result.stderr)
    assert waited and float(waited.group(1)) < 3.0, result.stderr
    # Exit says what it waited for in its own words: the user called no barrier_wait.
    assert re.search(r"exit stopped waiting after [0-9.]+ s: a computation on", result.stderr)
    assert "barrier_wait" not in result.stderr


PENDING_CALL = """
    import threading, time
    import jax, numpy as np
    import hostcallback as hcb

    never = threading.Event()
    errors = []

    def run():
        try:
            jax.jit(lambda x: hcb.call(lambda v: never.wait() and v, x, result_shape=x))(
                np.float32(1)).block_until_ready()
        except Exception as error:
            errors.append(str(error))

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    deadline = time.monotonic() + 60
    while hcb.queue_stats()[jax.devices()[0]]["calls_waiting"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    {ending}
    """


@pytest.mark.parametrize("transport", ["native", "callback"])
def test_stop_while_a_call_is_pending_fails_the_call_clearly(transport):
    result = run_python(PENDING_CALL.format(ending="""
    hcb.stop_outfeed_receiver(timeout=2)
    caller.join(60)
    stats = hcb.queue_stats()[jax.devices()[0]]
    print(not caller.is_alive(), "receiver was stopped" in errors[0], stats["calls_waiting"])
    """), env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True True 0", result.stderr


@pytest.mark.parametrize("transport", ["native", "callback"])
def test_exit_while_a_call_is_pending_ends_within_one_exit_timeout(transport):
    result = run_python(PENDING_CALL.format(ending="print('exiting', flush=True)"),
                        env={"HOSTCALLBACK_TRANSPORT": transport,
                             "HOSTCALLBACK_EXIT_TIMEOUT": "3"})
    assert result.returncode == 0, result.stderr
    waited = re.search(r"waited ([0-9.]+) s of HOSTCALLBACK_EXIT_TIMEOUT=3 s", result.stderr)
    assert waited, result.stderr
    # One deadline for the whole exit: the barrier and the joins share it (it was 2 x 3 s).
    assert float(waited.group(1)) < 4.5, result.stderr
