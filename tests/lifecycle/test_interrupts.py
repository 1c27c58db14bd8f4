"""Ctrl-C during a long computation of calls: the first one ends it at once, as it ends one of
JAX's own host callbacks; a signal handler that does not raise lets it go on; a Ctrl-C the
program caught leaves later calls working.

JAX runs a computation that holds a call on the thread that dispatched it, the main thread, which
runs Python's signal handlers only when it gets back to Python: these programs send the signal
while that thread waits for an answer, deep inside a scan of a million steps.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import TRANSPORTS

# The program under test. It restores Ctrl-C's default handler (a run in a background job starts
# with SIGINT ignored), and says "calling" on stderr once its first call has run.
SCAN_OF_CALLS = """
import signal, sys, time
signal.signal(signal.SIGINT, {handler})
import jax, jax.numpy as jnp, numpy as np
import hostcallback as hcb
hcb.configure(transport="{transport}")
said = []
def fetch(i):
    if not said:
        said.append(1)
        print("calling", file=sys.stderr, flush=True)
    time.sleep({delay})
    return np.float32(i) * 2

def step(total, i):
    return total + hcb.call(fetch, i.astype(jnp.float32),
                            result_shape=jax.ShapeDtypeStruct((), jnp.float32)), None

def run(steps):
    total, _ = jax.lax.scan(step, jnp.float32(0), jnp.arange(steps))
    return float(total)
{then}
"""


def start(transport: str = "native", handler: str = "signal.default_int_handler",
          then: str = "print(run(2_000_000))", delay: float = 0) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    program = SCAN_OF_CALLS.format(transport=transport, handler=handler, then=then,
                                   delay=delay)
    return subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def interrupt_once_calling(child: subprocess.Popen) -> float:
    """Sends SIGINT half a second after the child's first call; returns when it was sent."""
    line = child.stderr.readline()
    assert line == "calling\n", line + child.stderr.read()
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    return time.monotonic()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_first_ctrl_c_ends_a_long_scan_of_calls_at_once(transport):
    child = start(transport)
    sent = interrupt_once_calling(child)
    stdout, stderr = child.communicate(timeout=60)
    took = time.monotonic() - sent
    assert took < 5, f"ended {took:.1f} s after Ctrl-C"
    assert stdout == ""
    if transport == "native":  # it ends as Python ends a program on a KeyboardInterrupt
        assert "interrupted (KeyboardInterrupt)" in stderr
        assert child.returncode == -signal.SIGINT, stderr
        assert "KeyboardInterrupt" in stderr.splitlines(), stderr
    else:  # as with JAX's own callbacks: the computation's error is the KeyboardInterrupt
        # (raised in the call's wait, which says so, or in JAX's code around it)
        assert child.returncode == 1, stderr
        assert "JaxRuntimeError: INTERNAL: CpuCallback error" in stderr
        assert "KeyboardInterrupt" in stderr


@pytest.mark.timeout(120)
def test_a_signal_handler_that_does_not_raise_lets_the_calls_go_on():
    child = start(handler="lambda signum, frame: print('handled', file=sys.stderr, flush=True)",
                  then="print(run(300))", delay=0.01)
    # The handler runs inside the scan, as it would inside JAX's own callbacks.
    interrupt_once_calling(child)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    assert "handled" in stderr
    assert stdout == f"{2.0 * sum(range(300))}\n"


@pytest.mark.timeout(120)
def test_a_ctrl_c_the_program_caught_leaves_later_calls_working():
    child = start(then="""
try:
    run(2_000_000)
except KeyboardInterrupt:
    print("caught", file=sys.stderr, flush=True)
print(run(10))
""")
    interrupt_once_calling(child)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    assert "caught" in stderr
    assert stdout == f"{2.0 * sum(range(10))}\n"


class _InterruptedReacquire:
    """A Condition whose wait ends as a Ctrl-C can end it on the main thread: the lock released,
    and the KeyboardInterrupt raised by the acquire on the way back."""

    def __init__(self, lock):
        self._lock = lock

    def wait(self, timeout=None):
        self._lock.release()
        raise KeyboardInterrupt

    def notify_all(self):
        pass


def test_a_ctrl_c_that_ends_a_barriers_wait_is_a_keyboard_interrupt_not_a_lock_error():
    import jax

    from hostcallback._host.receiver import ReceiverPool, queue_key
    from hostcallback._records.registry import registry

    pool = ReceiverPool(registry)
    device = jax.devices()[0]
    key = queue_key(device)
    pool._devices, pool._markers = {key: device}, {key: set()}
    pool._marker_seen = _InterruptedReacquire(pool._lock)
    with pytest.raises(KeyboardInterrupt):
        pool.wait_for_markers({key: {5}}, range(4, 8), None, send_errors=[], what="barrier_wait",
                              timeout=None, notice=None)
    assert pool._lock.acquire(blocking=False)  # not left held
    pool._lock.release()
