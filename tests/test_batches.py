"""Tap functions with ``tap_batch`` get each run of their records in one call
(hostcallback.batches), in order, on both transports."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hostcallback as hcb
from hostcallback.receiver import CallbackException


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


def test_a_batch_names_its_device_and_the_consumer_context_is_absent(transport):
    tap = BatchTap()
    jax.pmap(lambda x: hcb.id_tap(tap, x * 2))(jnp.arange(4.0))
    hcb.barrier_wait()
    by_device = {batch[0].id: [float(v) for v in batch[2]] for batch in tap.batches}
    assert by_device == {d.id: [2.0 * i] for i, d in enumerate(jax.local_devices())}
    assert all(batch[4] is None for batch in tap.batches)


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
