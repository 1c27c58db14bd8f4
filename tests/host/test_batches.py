"""Tap functions with ``tap_batch`` get each run of their records in one call
(hostcallback._host.batches), in order, on both transports."""

import threading
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from hostcallback import CallbackException


class BatchTap:
    """Files every record it is handed, batch by batch."""

    def __init__(self):
        self.lock = threading.Lock()
        self.batches = []  # (device, sequences, values, transforms, current_record())

    def __call__(self, arg, transforms):  # never called: the receiver hands batches
        raise AssertionError("a tap function with tap_batch was called per record")

    def tap_batch(self, batch):
        with self.lock:
            self.batches.append((batch.device, batch.sequences(), list(batch.values()),
                                 batch.transforms, hcb.current_record(), len(batch)))

    def values(self):
        return [value for batch in self.batches for value in batch[2]]


def test_every_record_arrives_once_in_program_order(transport):
    tap = BatchTap()
    jax.jit(lambda x: lax.fori_loop(0, 5000, lambda i, c: hcb.id_tap(tap, c + i), x))(0)
    hcb.barrier_wait()
    assert [int(v) for v in tap.values()] == [sum(range(i + 1)) for i in range(5000)]
    sequences = [s for batch in tap.batches for s in batch[1]]
    assert sequences == sorted(sequences) and len(set(sequences)) == 5000
    assert all(length == len(batch[1]) for *batch, length in tap.batches)


@pytest.mark.needs_internals("the device of callback-transport records", transport="callback")
def test_a_batch_names_its_device(transport):
    tap = BatchTap()
    jax.pmap(lambda x: hcb.id_tap(tap, x * 2))(jnp.arange(4.0))
    hcb.barrier_wait()
    by_device = {batch[0].id: [float(v) for v in batch[2]] for batch in tap.batches}
    assert by_device == {d.id: [2.0 * i] for i, d in enumerate(jax.local_devices())}


def test_current_record_names_the_first_record_then_each_one_values_yields(transport):
    seen = []

    class Site(BatchTap):
        def tap_batch(self, batch):
            first = hcb.current_record()
            each = [hcb.current_record().sequence for _ in batch.values()]
            seen.append((first.sequence, first.device == batch.device, each,
                         batch.sequences(), hcb.current_record().sequence))

    jax.jit(lambda x: lax.fori_loop(0, 500, lambda i, c: hcb.id_tap(Site(), c + i), x))(0)
    hcb.barrier_wait()
    assert sum(len(each) for _, _, each, _, _ in seen) == 500
    for first, same_device, each, sequences, after in seen:
        assert same_device and each == sequences and first == after == sequences[0]


def test_a_computation_traced_inside_tap_batch_is_refused_not_left_to_hang(transport):
    class Reentrant(BatchTap):
        def tap_batch(self, batch):
            jax.jit(lambda x: hcb.call(lambda y: y, x, result_shape=x))(1.0)

    jax.jit(lambda x: hcb.id_tap(Reentrant(), x))(0)
    with pytest.raises(CallbackException, match="traced inside a tap consumer"):
        hcb.barrier_wait()


def test_an_object_that_answers_every_attribute_is_called_per_record(transport):
    tap = mock.Mock()
    jax.jit(lambda x: lax.fori_loop(0, 3, lambda i, c: hcb.id_tap(tap, c + 1), x))(0)
    hcb.barrier_wait()
    assert [int(call.args[0]) for call in tap.call_args_list] == [1, 2, 3]
    tap.tap_batch.assert_not_called()


@pytest.mark.needs_internals("program order inside a computation")
def test_taps_of_two_sites_interleaved_keep_their_order_across_sites(transport):
    order = []
    lock = threading.Lock()

    class Site(BatchTap):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def tap_batch(self, batch):
            with lock:
                order.extend((self.name, int(v)) for v in batch.values())

    first, second = Site("a"), Site("b")

    def body(i, c):
        hcb.id_tap(first, i)
        hcb.id_tap(second, i)
        return c

    jax.jit(lambda x: lax.fori_loop(0, 300, body, x))(0)
    hcb.barrier_wait()
    assert order == [(name, i) for i in range(300) for name in ("a", "b")]


@pytest.mark.needs_internals("transforms in tap functions")
def test_a_batch_gets_the_transforms_of_its_records(transport):
    tap = BatchTap()
    jax.vmap(lambda x: hcb.id_tap(tap, x))(jnp.arange(3.0))
    hcb.barrier_wait()
    assert tap.batches[0][3] == (("batch", {"batch_dims": (0,)}),)


def test_an_exception_in_tap_batch_is_reported_at_the_barrier_and_later_records_flow(transport):
    class Failing(BatchTap):
        def tap_batch(self, batch):
            if any(int(v) == 3 for v in batch.values()):
                raise ValueError("three")
            super().tap_batch(batch)

    tap = Failing()
    step = jax.jit(lambda x: hcb.id_tap(tap, x))
    for i in range(6):
        step(i)
        if i == 3:
            with pytest.raises(CallbackException, match="three"):
                hcb.barrier_wait()
        else:
            hcb.barrier_wait()
    assert [int(v) for v in tap.values()] == [0, 1, 2, 4, 5]


def test_a_call_is_never_batched_even_when_its_function_has_tap_batch(transport):
    class Answer:
        def __call__(self, x):
            return x + 1

        def tap_batch(self, batch):
            raise AssertionError("a call was batched")

    f = jax.jit(lambda x: hcb.call(Answer(), x, result_shape=jax.ShapeDtypeStruct((), x.dtype)))
    assert int(f(np.int32(4))) == 5
    hcb.barrier_wait()
