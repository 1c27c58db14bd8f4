"""The error path cannot fail: an exception that cannot describe itself, or a logging handler
that raises, still reaches barrier_wait (taps) or the computation (calls), and the receiver
lives on."""

import logging
import time

import jax
import jax.numpy as jnp
import pytest

import hostcallback as hcb
from hostcallback._host.failures import FailureLog


class Undescribable(Exception):
    def __str__(self):
        return self.detail  # an attribute it never set


def raises_undescribable(*args):
    raise Undescribable()


def test_a_tap_whose_exception_cannot_be_formatted_is_reported_by_its_type(transport, collector):
    jax.jit(lambda x: hcb.id_tap(raises_undescribable, x))(1)
    with pytest.raises(hcb.CallbackException, match="Undescribable \\(its message could not be "
                                                    "formatted: AttributeError\\)") as info:
        hcb.barrier_wait(timeout=60)
    assert type(info.value.__cause__) is Undescribable
    jax.jit(lambda x: hcb.id_tap(collector, x))(2)  # the receiver lives
    hcb.barrier_wait(timeout=60)
    assert collector.values == [2]


def test_a_call_whose_exception_cannot_be_formatted_fails_its_computation_clearly(transport):
    call = jax.jit(lambda x: hcb.call(raises_undescribable, x, result_shape=x))
    with pytest.raises(Exception, match="Undescribable \\(its message could not be formatted"):
        call(jnp.float32(1)).block_until_ready()
    again = jax.jit(lambda x: hcb.call(lambda v: v + 1, x, result_shape=x))
    assert float(again(jnp.float32(1))) == 2.0  # the receiver lives


class RaisingHandler(logging.Handler):
    def handle(self, record):
        raise RuntimeError("the user's log handler is broken")


def test_a_logging_handler_that_raises_loses_the_log_line_not_the_failure(transport, collector):
    logger = logging.getLogger("hostcallback")
    handler = RaisingHandler()
    logger.addHandler(handler)
    try:
        jax.jit(lambda x: hcb.id_tap(raises_undescribable, x))(1)
        with pytest.raises(hcb.CallbackException):
            hcb.barrier_wait(timeout=60)
        jax.jit(lambda x: hcb.id_tap(collector, x))(2)
        hcb.barrier_wait(timeout=60)
    finally:
        logger.removeHandler(handler)
    assert collector.values == [2]


def test_a_logging_handler_that_raises_loses_the_summary_of_repeated_failures_not_the_barrier():
    log = logging.getLogger("hostcallback.test_error_path")
    log.propagate = False
    log.addHandler(RaisingHandler())
    failures = FailureLog(log, interval_s=0.05)
    for _ in range(3):  # the first goes out in full, the others wait for a summary
        try:
            failures.failed("tap consumer", "broken", "cpu:0", ValueError("no"))
        except RuntimeError:
            pass  # the first line's handler raised: Failures.record guards that call
    time.sleep(0.06)
    failures.flush(force=False)  # what every barrier_wait calls: must not raise
