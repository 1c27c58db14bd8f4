"""barrier_wait: everything dispatched before it is handled; consumer errors surface there."""

import pickle
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import wait_until


def test_barrier_waits_for_slow_consumers(transport, collector):
    def slow(arg, transforms):
        time.sleep(0.01)
        collector(arg, transforms)

    jax.jit(lambda x: lax.fori_loop(0, 20, lambda i, c: hcb.id_tap(slow, c + 1), x))(0)
    hcb.barrier_wait()
    assert [int(v) for v in collector.values] == list(range(1, 21))


def test_barrier_waits_for_taps_of_computations_still_running(transport, collector):
    def long_computation(x):
        x = lax.fori_loop(0, 200, lambda i, c: jnp.tanh(c @ c), x)
        return hcb.id_tap(collector, x.sum())

    jax.jit(long_computation)(jnp.eye(256))  # dispatched, not awaited
    hcb.barrier_wait()
    assert len(collector.values) == 1


@pytest.mark.timeout(120)
@pytest.mark.needs_internals("taps in a jit over a sharded mesh", transport="native")
@pytest.mark.parametrize("waiting", ["with a timeout", "from another thread"])
def test_barrier_waits_for_taps_of_a_sharded_computation_still_running(transport, collector,
                                                                       waiting):
    mesh = jax.make_mesh((4,), ("d",))
    x = jax.device_put(jnp.ones(1 << 20), NamedSharding(mesh, P("d")))

    def long_computation(x):
        x = lax.fori_loop(0, 200, lambda i, c: jnp.sin(c) + 1.0, x)
        return hcb.id_tap(collector, x.sum())

    out = jax.jit(long_computation)(x)  # dispatched, not awaited
    assert not out.is_ready()
    # Both wait on a thread other than the one that dispatched the computation.
    if waiting == "with a timeout":
        hcb.barrier_wait(timeout=60)
    else:
        waiter = threading.Thread(target=hcb.barrier_wait)
        waiter.start()
        waiter.join(60)
    assert len(collector.values) == 1


def test_consumer_errors_surface_at_the_next_barrier_with_cause_and_count(transport, collector):
    def flaky(arg, transforms):
        if int(arg) % 2:
            raise ValueError(f"odd {int(arg)}")
        collector(arg, transforms)

    jax.jit(lambda x: lax.fori_loop(0, 6, lambda i, c: hcb.id_tap(flaky, i), x))(0)
    with pytest.raises(hcb.CallbackException, match=r"Last one was: flaky.*odd 5\. 3 tap "
                                                    r"consumer call\(s\) raised.*the first: "
                                                    r"flaky.*odd 1") as info:
        hcb.barrier_wait()
    assert isinstance(info.value.__cause__, ValueError)
    assert [int(v) for v in collector.values] == [0, 2, 4]  # the others were still delivered
    hcb.barrier_wait()  # the next barrier is clean


def test_computation_keeps_running_when_a_consumer_raises(transport):
    def broken(arg, transforms):
        raise RuntimeError("boom")

    out = jax.jit(lambda x: hcb.id_tap(broken, x) * 2)(jnp.float32(3))
    assert out == 6
    with pytest.raises(hcb.CallbackException):
        hcb.barrier_wait()


def test_barrier_inside_jit_is_a_clear_error():
    with pytest.raises(RuntimeError, match="while tracing"):
        jax.jit(lambda x: (hcb.barrier_wait(), x)[1])(1.0)


def test_barrier_inside_a_consumer_is_a_clear_error(transport):
    def consumer(arg, transforms):
        hcb.barrier_wait()

    jax.jit(lambda x: hcb.id_tap(consumer, x))(1.0)
    with pytest.raises(hcb.CallbackException, match="inside a tap consumer") as info:
        hcb.barrier_wait()
    assert isinstance(info.value.__cause__, RuntimeError)


def test_barrier_times_out_instead_of_hanging(transport):
    release = threading.Event()

    def stuck(arg, transforms):
        release.wait(30)

    # Dispatched from a thread of its own, which may wait with it (delivery="dispatch" would).
    dispatcher = threading.Thread(target=lambda: jax.jit(lambda x: hcb.id_tap(stuck, x))(1.0))
    dispatcher.start()
    wait_until(lambda: any(s["fences_waiting"] for s in hcb.queue_stats().values()))
    with pytest.raises(TimeoutError, match="timed out after 0.2 s") as timed_out:
        hcb.barrier_wait(timeout=0.2)
    release.set()
    hcb.barrier_wait(timeout=30)
    dispatcher.join(30)
    # Its reason travels with it, as a process pool hands it back to its parent.
    unpickled = pickle.loads(pickle.dumps(timed_out.value))
    assert isinstance(unpickled, TimeoutError) and str(unpickled) == str(timed_out.value)
    assert unpickled.reason == timed_out.value.reason


@pytest.mark.needs_internals("the begin and fence that show a device waiting for its receiver")
def test_a_barriers_timeout_holds_while_steps_pile_up_behind_a_busy_consumer(transport):
    """Another thread's steps wait behind one held by a busy consumer, until XLA's client takes
    no more in flight on the device: the barrier's timeout still holds (it sends nothing there
    that would wait for a free place)."""
    release = threading.Event()
    release.set()

    def busy(arg, transforms):
        release.wait(30)

    step = jax.jit(lambda x: hcb.id_tap(busy, jnp.tanh(x @ x / 64)))
    x = jnp.eye(64)
    step(x).block_until_ready()
    hcb.barrier_wait(timeout=30)  # compiled, with the barrier's own computations
    release.clear()  # the consumer is busy from now on
    dispatcher = threading.Thread(target=lambda: [step(x) for _ in range(60)])
    dispatcher.start()
    time.sleep(0.5)  # the first step waits for the consumer, the rest behind it
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 1 s"):
        hcb.barrier_wait(timeout=1)
    assert time.monotonic() - start < 3
    release.set()
    hcb.barrier_wait(timeout=60)
    dispatcher.join(60)


def test_barrier_covers_computations_from_other_threads(transport, collector):
    tap = jax.jit(lambda x: hcb.id_tap(collector, x))

    def dispatch_many(start):
        for i in range(start, start + 20):
            tap(i)

    threads = [threading.Thread(target=dispatch_many, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waiters = [threading.Thread(target=hcb.barrier_wait) for _ in range(3)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(60)
    assert sorted(int(v) for v in collector.values) == sorted(
        i for t in range(4) for i in range(100 * t, 100 * t + 20))


def test_barrier_covers_single_and_multi_device_computations_whose_results_were_dropped(
        transport, collector):
    per_device = jax.pmap(lambda x: hcb.id_tap(collector, x))
    single = jax.jit(lambda x: hcb.id_tap(collector, x))
    for trial in range(15):
        collector.clear()
        per_device(jnp.arange(4.0) + trial)  # results dropped on purpose
        single(jnp.float32(trial))
        hcb.barrier_wait()
        assert len(collector.calls) == 5, f"trial {trial}"


def test_queue_stats_count_barrier_markers_apart_from_records(transport):
    before = {d: s["records_enqueued"] for d, s in hcb.queue_stats().items()}
    jax.jit(lambda x: hcb.id_tap(lambda a, t: None, x))(1)
    hcb.barrier_wait()
    stats = hcb.queue_stats()
    assert sum(s["records_enqueued"] - before[d] for d, s in stats.items()) == 1
    assert all(s["barrier_markers_enqueued"] == s["barrier_markers_delivered"] > 0
               for s in stats.values())


@pytest.mark.needs_internals("the computations' begin and fence")
def test_a_barriers_markers_are_not_tapped_computations_a_later_barrier_follows(transport):
    """A barrier follows the tapped computations that begin just after one ended (they may have
    been dispatched before it); its own markers must not count, or every barrier would wait
    out that window behind the one before."""
    from hostcallback._native import outfeed

    jax.jit(lambda x: hcb.id_tap(lambda a, t: None, x))(1)
    hcb.barrier_wait()
    begun = [outfeed.computations(d.id)["begun"] for d in jax.local_devices()]
    hcb.barrier_wait()
    hcb.barrier_wait()
    assert [outfeed.computations(d.id)["begun"] for d in jax.local_devices()] == begun


def test_a_flush_hook_that_raises_is_the_barriers_error_once():
    """A sink that could not write what it holds (its flush raised) says so at the barrier,
    as a consumer's error does; once it writes again, the barriers are clean."""
    from hostcallback.addons import add_flush_hook

    class SometimesCannotWrite:
        full = True
        flushes = 0

        def __repr__(self):
            return "SometimesCannotWrite()"

        def flush(self):
            self.flushes += 1
            if self.full:
                raise OSError("the disk is full")

    owner = SometimesCannotWrite()
    add_flush_hook(owner)
    jax.jit(lambda x: hcb.id_tap(lambda *_: None, x))(1.0)
    with pytest.raises(hcb.CallbackException, match=r"SometimesCannotWrite\(\)\.flush") as caught:
        hcb.barrier_wait()
    assert "the disk is full" in str(caught.value)
    owner.full = False
    flushes = owner.flushes
    hcb.barrier_wait()
    assert owner.flushes == flushes + 1  # still flushed after it failed
