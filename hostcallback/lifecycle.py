"""Start, barrier and stop: the host side's life, above both the receivers and the tap primitive.

The receivers start the first time a tap is traced. ``barrier_wait`` covers every tapped
computation dispatched before it, from any thread, although XLA's CPU client orders
single-device computations only per dispatching thread (and launches those over several devices
one after another, client-wide). It waits, in turn, for a probe per device dispatched from the
calling thread (ready after what this thread dispatched there before); for the tapped
computations running on each device when it began, and those that begin right after one of them
ends (another thread's next step, already dispatched; fence.py, _native/computations.h), or, where
one was lowered lately and none has run since, the first to begin; for every
live jax.Array not yet ready (a computation ends only once its taps were handled); and then for
its marker computations (taps of the barrier's own consumer, built with ``binding``), one on
each device and one over all local devices, which every device's receiver handles after what
was queued before. Then the flush hooks run (sinks that buffer: a barrier also means "written")
and consumer failures are raised.

At exit everything queued is delivered within ``HOSTCALLBACK_EXIT_TIMEOUT``; a Ctrl-C meanwhile
leaves the rest.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np

from hostcallback import _jax as jx
from hostcallback import config
from hostcallback._host.receiver import (
    FORKED,
    Notice,
    ReceiverPool,
    ReceiverStoppedError,
    receivers,
)
from hostcallback._native import outfeed
from hostcallback._records import wire
from hostcallback._records.registry import BARRIER_MARKER_ID
from hostcallback._trace import binding, transport
from hostcallback.errors import CallbackException, WaitTimedOut, name_of

logger = logging.getLogger("hostcallback")

_BARRIER_SHARE = 0.8  # of stop()'s (and so of exit's) one deadline
# After a tapped computation ends, how long a barrier watches for the next one that was already
# dispatched (its inputs were the results just completed) to begin, and how many it follows so
# on a device: XLA's CPU client keeps at most 32 computations in flight per device.
_FOLLOW_SECONDS = 0.02
_FOLLOW_SECONDS_AT_STOP = 0.2
# Where a counted tapped computation (fence.py) was lowered lately and none has run since, how
# long a barrier waits for the first to begin: a first run can begin tens of milliseconds after
# its dispatch (more under load), and one dispatched from another thread is seen only once it
# begins.
_FIRST_BEGIN_SECONDS = 0.1
_FIRST_BEGIN_SECONDS_AT_STOP = 1.0
_FOLLOWED_AT_MOST = 32
_READY_POLL_SECONDS = 0.001
_READY_POLL_MAX_SECONDS = 0.02
_EXIT_NOTICE_SECONDS = 3.0  # exit says what it waits for once it has waited this long
# The portable barrier's fence computations tap marker + 2 (and + 3): values of its own, which
# fit in uint32 (a marker travels as uint32 when x64 is off) and no barrier waits for.
_FENCE_OFFSET = 2


def _ended_by_ctrl_c() -> bool:
    """The program is ending on an uncaught KeyboardInterrupt (Python sets sys.last_type when it
    prints an uncaught exception, before the exit handlers run)."""
    if hasattr(sys, "ps1"):  # interactive: last_type may be any earlier Ctrl-C of the session
        return False
    last = getattr(sys, "last_type", None)
    return isinstance(last, type) and issubclass(last, KeyboardInterrupt)


class _Dispatcher:
    """One thread, started with the receivers, that dispatches the markers of barriers with a
    deadline: dispatching waits while a device is busy (a computation blocked on a full queue or
    a pending call), and the barrier's deadline must hold meanwhile. It exists before exit
    because Python 3.12 refuses to start a thread once interpreter exit has begun."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hostcallback-barrier-dispatcher")
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def wait_idle(self, timeout: float) -> bool:
        """Waits at most ``timeout`` s for the work submitted so far to end; whether it did."""
        if self._thread is None or not self._thread.is_alive():
            return True
        return self.submit(lambda: None).wait(timeout)

    def submit(self, work) -> threading.Event:
        """Runs ``work()`` on the thread; the event is set once it has returned or raised."""
        done = threading.Event()
        self._requests.put((work, done))
        return done

    def _run(self) -> None:
        while True:
            work, done = self._requests.get()
            try:
                work()
            except BaseException:  # noqa: BLE001 - work reports its own errors
                pass
            finally:
                done.set()
                del work, done


class Lifecycle:
    """Starts the receivers, runs barriers and flush hooks, and stops them (at exit too)."""

    def __init__(self, pool: ReceiverPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._next_marker = itertools.count(1)
        self._dispatcher = _Dispatcher()
        self._flush_hooks: weakref.WeakSet = weakref.WeakSet()
        self._marker_computations: dict[str, tuple] = {}  # per transport, built on first use
        self._probes: list[tuple] = []  # (computation, its argument), built on first use
        self._stop_gave_up = False  # stop()'s barrier timed out
        self._said_left = False  # exit said how many records a Ctrl-C left (_leave_at_once)
        self._markers_compiled: threading.Event | None = None  # set once _compile_markers ended

    def ensure_started(self) -> None:
        """Starts one receiver per local device, once; refuses after stop_outfeed_receiver()."""
        if self._pool.start():
            atexit.register(self._at_exit)  # first: exit must deliver even if the next fails
            self._dispatcher.start()
            self._markers_compiled = self._dispatcher.submit(self._compile_markers)

    @property
    def markers_compiled(self) -> bool:
        """Whether the barrier's marker computations, compiled as the receivers start, are."""
        return self._markers_compiled is not None and self._markers_compiled.is_set()

    def wait_before_fork(self) -> None:
        """os.register_at_fork's before handler: a fork() while the dispatcher compiles the
        markers would give the child JAX's compilation locks held by a thread it does not have,
        and its first jit would hang instead of refusing its taps; so fork waits for that compile
        (at most _FORK_WAIT_SECONDS)."""
        compiled = self._markers_compiled
        if compiled is not None and threading.current_thread() is not self._dispatcher.thread:
            compiled.wait(_FORK_WAIT_SECONDS)

    def _compile_markers(self) -> None:
        """On the dispatcher thread, right after the start: compiles the barrier's marker
        computations by sending markers no barrier waits for. Exit's barrier sends its markers
        from this thread too, and one that gives up must not leave the thread compiling inside
        jaxlib when the interpreter finalizes: CPython ends a thread that takes the GIL back then,
        and that ending aborts the process from inside jaxlib."""
        try:
            self._send_markers(_UNAWAITED_MARKER)
        except Exception:  # noqa: BLE001 - a barrier that needs them says what fails
            logger.debug("hostcallback: compiling the barrier's markers failed", exc_info=True)

    # ---- barrier ----

    def barrier_wait(self, logging_name: str | None = None, timeout: float | None = None,
                     raise_errors: bool = True, notice_after: float | None = None,
                     follow_long: bool = False, flush: bool = True) -> None:
        self._refuse_caller("barrier_wait()")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._pool.started:
            self._pool.raise_if_dead()
            notice = Notice(notice_after, self._pool.say_what_is_waited_for)
            running = self._pool.computations_begun()
            with jx.outside_user_mesh():
                self._wait_for_this_threads_work(deadline, timeout, notice)
            self._pool.wait_for_computations(
                running, deadline, follow_s=_FOLLOW_SECONDS_AT_STOP if follow_long
                else _FOLLOW_SECONDS, followed=_FOLLOWED_AT_MOST, timeout=timeout,
                notice=notice, lowered_at=_last_counted_lowering(),
                first_begin_s=_FIRST_BEGIN_SECONDS_AT_STOP if follow_long
                else _FIRST_BEGIN_SECONDS)
            _wait_until_ready(_live_results_not_ready(), deadline, timeout, notice)
            self._wait_for_markers(logging_name, timeout, deadline, notice)
        if flush:
            self.run_flush_hooks(deadline)
        self._pool.failures.log.flush(force=False)
        if raise_errors:
            self._pool.failures.raise_pending()

    def _refuse_caller(self, what: str) -> None:
        """Raises where a wait for the taps cannot be made: in a consumer, while tracing, in a
        fork()ed child."""
        if self._pool.is_receiver_thread():
            raise RuntimeError(
                f"{what} was called from inside a tap consumer; it would wait for itself. "
                "Call it from the code that runs the computation instead.")
        if jx.is_tracing():
            raise RuntimeError(
                f"{what} was called while tracing (inside jit, vmap, grad, ...); it waits "
                "on the host for taps and cannot be part of a computation. Call it after the "
                "computation, outside any transformation.")
        if self._pool.forked:  # what the parent left queued and failed is the parent's
            raise ReceiverStoppedError(FORKED)

    def add_flush_hook(self, owner: Any) -> None:
        """Calls ``owner.flush()`` after every barrier and at exit, for as long as owner lives
        (sinks that buffer use it so that a barrier also means 'on disk')."""
        self._flush_hooks.add(owner)

    @property
    def exiting(self) -> bool:
        """Interpreter exit's delivery has begun (addons.exiting())."""
        return self._pool.exiting

    def run_flush_hooks(self, deadline: float | None = None) -> None:
        """Flushes every hook; one that can bound its wait (``flush_before``, e.g. SocketSink)
        gets the caller's deadline (monotonic), so a barrier's timeout and exit bound it too.
        A hook that raises did not write what it holds: its error is reported as a consumer's
        is, by this barrier (at exit: logged)."""
        for owner in list(self._flush_hooks):
            try:
                flush_before = getattr(owner, "flush_before", None)
                if flush_before is not None:
                    flush_before(deadline)
                    continue
                owner.flush()
            except Exception as error:  # noqa: BLE001 - the barrier raises it
                self._pool.failures.record("flush", f"{name_of(owner)}.flush()", "the host", error)

    def _wait_for_this_threads_work(self, deadline: float | None, timeout: float | None,
                                    notice: Notice) -> None:
        """Waits until what this thread dispatched before to single devices is complete: XLA
        runs a single-device computation after those its thread dispatched before. So a probe
        per device, too large for XLA to run while dispatching it (it would wait for them right
        there, past any deadline), is ready only after them. Where a computation waits for the
        host (a busy consumer), a device may hold as many computations in flight as XLA's client
        takes, and a probe dispatched to it would wait for a free one, past the deadline: with a
        deadline, the probe waits until the device no longer waits for the host, and at the
        deadline the barrier times out. (Not in the portable mode, whose every tap waits for
        its receiver: its barriers ran behind them as before.)"""
        if not self._probes:
            self._probes = _make_probes(self._pool.platform_groups())
        outs = []
        for probe, argument in self._probes:
            device = _device_of(argument)
            if deadline is not None and not jx.PORTABLE:
                while self._pool.waits_for_receiver(device):
                    if time.monotonic() >= deadline:
                        raise WaitTimedOut(
                            "barrier_wait", timeout, f"a computation on {device} still waits "
                            "for its receiver (a consumer still runs)")
                    if notice.due():
                        notice.say()
                    time.sleep(_READY_POLL_SECONDS)
            outs.append(probe(argument))
        _wait_until_ready(outs, deadline, timeout, notice)

    def _wait_for_markers(self, logging_name: str | None, timeout: float | None,
                          deadline: float | None, notice: Notice | None = None) -> None:
        """``deadline`` (monotonic) is the barrier's, what the waits before left of ``timeout``."""
        with self._lock:
            marker = 4 * next(self._next_marker)  # marker, marker + 1; fences marker + 2, + 3
        grouped = self._pool.platform_groups()
        expected = {key: {marker, marker + 1} if len(grouped[key[0]]) > 1 else {marker}
                    for key in self._pool.devices}
        if logging_name:
            logger.debug("hostcallback: barrier %s (marker %d) starts", logging_name, marker)
        send_errors: list[BaseException] = []
        sent = None
        if timeout is None:
            self._send_markers(marker)
        else:
            # Dispatching a marker waits while its device is busy: the dispatcher thread sends
            # them, so that the deadline holds.

            def send() -> None:
                try:
                    self._send_markers(marker)
                except Exception as error:  # noqa: BLE001 - raised by the waiting barrier
                    send_errors.append(error)
                    self._pool.wake_waiters()

            sent = self._dispatcher.submit(send)
        what = f"barrier_wait{f' ({logging_name})' if logging_name else ''}"
        self._pool.wait_for_markers(expected, range(marker, marker + 4), deadline,
                                    send_errors=send_errors, what=what, timeout=timeout,
                                    notice=notice)
        if sent is not None:
            # Its markers arrived, so its dispatches are done: let it return before we do (a
            # thread still inside jaxlib when the interpreter exits aborts the process).
            sent.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if logging_name:
            logger.debug("hostcallback: barrier %s (marker %d) done", logging_name, marker)

    def _send_markers(self, marker: int) -> None:
        """A single-device marker (value ``marker``) to each device, and per platform with
        several devices one computation over them all that sends ``marker + 1`` from each.
        The markers run on devices and meshes of their own: the user's mesh (``jax.set_mesh``)
        is set aside while they are sent."""
        if jx.PORTABLE:
            self._send_markers_from_host(marker)
            return
        with jx.outside_user_mesh():
            self._send_markers_outside_user_mesh(marker)

    def _send_markers_from_host(self, marker: int) -> None:
        """The portable mode's barrier: once a fence computation on every device has finished
        (each runs after what was dispatched to its device before it, from any thread, so the
        taps of those computations are queued), a marker enqueued from the host comes after all
        of them, on every device (``marker + 1`` too where a barrier expects two).
        ``jax.effects_barrier()`` would not do: JAX keeps its effect tokens per thread, and a
        barrier with a timeout, or one called from another thread, runs on a thread that did not
        dispatch those computations."""
        with jx.outside_user_mesh():
            self._send_markers_outside_user_mesh(marker + _FENCE_OFFSET)
        grouped = self._pool.platform_groups()
        for (platform, ordinal) in self._pool.devices:
            values = [marker, marker + 1] if len(grouped[platform]) > 1 else [marker]
            for value in values:
                outfeed.enqueue(ordinal, BARRIER_MARKER_ID,
                                [wire.as_leaf(np.array(value, dtype=np.uint64))],
                                platform=platform)

    def _send_markers_outside_user_mesh(self, marker: int) -> None:
        # The markers travel by the transport in use now, as the taps they wait for do.
        transport_name = transport.default_transport()
        if transport_name not in self._marker_computations:

            def tap_marker(x):
                return binding.bind([x], consumer_id=BARRIER_MARKER_ID, transport=transport_name)

            all_devices_markers = []
            for devices in self._pool.platform_groups().values():
                if len(devices) > 1:
                    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
                    spec = jax.sharding.PartitionSpec("devices")
                    all_devices_markers.append((jax.jit(jax.shard_map(
                        lambda x: tap_marker(x.reshape(()))[0].reshape(1), mesh=mesh,
                        in_specs=spec, out_specs=spec)), jax.sharding.NamedSharding(mesh, spec),
                        len(devices)))
            self._marker_computations[transport_name] = (jax.jit(tap_marker), all_devices_markers)
        single_device_marker, all_devices_markers = self._marker_computations[transport_name]
        outs = [single_device_marker(jax.device_put(np.uint64(marker), device))
                for device in self._pool.devices.values()]
        for computation, sharding, count in all_devices_markers:
            markers = np.full(count, marker + 1, dtype=np.uint64)
            outs.append(computation(jax.device_put(markers, sharding)))
        # A marker arrives before its computation has finished (on the callback transport, before
        # XLA's thread has left our callback and Python): the barrier ends only once they have,
        # so that exit never lets finalization begin with one of them still inside Python.
        jax.block_until_ready(outs)

    # ---- stop and exit ----

    def stop(self, timeout: float | None = None, notice_after: float | None = None,
             flush: bool = True) -> int:
        """Delivers what is queued, then stops the receivers; returns how many records were
        left. ``timeout`` bounds the whole stop (barrier and joins together), not each step;
        with ``notice_after``, a stop that has waited that long says on stderr what it waits
        for. ``flush=False`` leaves the flush hooks to the caller (exit flushes them once, last,
        so that a sink says once what it loses)."""
        self._stop_gave_up = False  # (an earlier stop's, which exit's stop must not report)
        if not self._pool.started:
            self._pool.mark_stopped()
            return 0
        self._refuse_caller("stop_outfeed_receiver()")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        try:
            # The barrier gets most of the deadline; the rest is for the computations that
            # closing the queues wakes (their taps fail with "stopped", or at exit are dropped)
            # and for the joins.
            self.barrier_wait(timeout=None if timeout is None else timeout * _BARRIER_SHARE,
                              raise_errors=False, notice_after=notice_after, follow_long=True,
                              flush=flush)
        except TimeoutError as error:  # (exit's own warning follows with the time it waited)
            self._stop_gave_up = True
            who = "exit" if self._pool.exiting else "stop_outfeed_receiver()"
            logger.warning("hostcallback: %s stopped waiting after %.1f s: %s", who,
                           time.monotonic() - started, getattr(error, "reason", error))
        except CallbackException as error:
            logger.warning("hostcallback: %s", error)
        except Exception:
            # The barrier itself failed (dispatching its markers, say): the queues close all
            # the same, so that no computation waits on them for good; then the error follows.
            self._pool.close(deadline)
            raise
        return self._pool.close(deadline)

    def _at_exit(self) -> None:
        """Delivers what is queued, within HOSTCALLBACK_EXIT_TIMEOUT; a Ctrl-C meanwhile leaves
        the rest (one line says how many), and a receiver finishes at most its batch. A consumer
        that outlasts the deadline runs on until its receiver next comes back from our C++ for
        the GIL, where it parks (the exit gate, closed last); one that runs JAX then may still be
        ended inside jaxlib as the interpreter finalizes (the "Reliability" document)."""
        if self._pool.forked:  # the parent delivers its taps and flushes its sinks
            return
        try:
            self._deliver_at_exit()
        finally:
            # A barrier that gave up may have left the dispatcher inside jaxlib, dispatching
            # markers behind a computation that waited for the host; the queues are closed now,
            # so that ends, and the thread must be out of jaxlib before finalization begins.
            if not self._dispatcher.wait_idle(_EXIT_DISPATCHER_SECONDS):
                logger.debug("hostcallback: the barrier's dispatcher is still busy at exit")
            # A receiver still in a consumer now parks when it next comes back for the GIL,
            # rather than wait for it while the interpreter finalizes (gil.h says why).
            if not outfeed.close_exit_gate(_EXIT_GATE_SECONDS):
                logger.debug("hostcallback: a receiver thread still waits for the GIL at exit")

    def _deliver_at_exit(self) -> None:
        self._pool.exiting = True
        # Taps that find the queues closed from now on are dropped (outfeed.dropped_at_exit()
        # counts them), not errors that JAX's own exit handlers would print; the warning below
        # says that the taps of computations still running are dropped.
        outfeed.set_exiting()
        timeout = config.settings.exit_timeout_s
        start = time.monotonic()
        deadline = start + timeout
        # After a Ctrl-C the user is waiting to leave: say at once what is left and how to skip
        # it, and take a computation that shows nothing for a second for one the Ctrl-C ended
        # (a KeyboardInterrupt raised in a JAX callback fails it where no handler of ours sees).
        notice_after = _EXIT_NOTICE_SECONDS
        if _ended_by_ctrl_c() or 0 <= outfeed.seconds_since_interrupt() < _RECENT_CTRL_C_SECONDS:
            notice_after = 0.0
            self._pool.presumed_failed_s = _PRESUMED_FAILED_AFTER_CTRL_C
        if _ended_by_ctrl_c():
            # Computations of calls end at their next call, as on the main thread a Ctrl-C ends
            # them (XLA's worker threads, which run pmap and sharded parts, never see it). Not
            # after a Ctrl-C the program handled: its calls are wanted.
            outfeed.interrupt_calls()

        try:
            undelivered = self.stop(timeout=timeout, notice_after=notice_after, flush=False)
            self.run_flush_hooks(deadline)  # once, last: a sink says then what it loses
        except KeyboardInterrupt:
            leave = True
        else:
            leave = False
        if leave:
            # A second Ctrl-C that came before SIGINT was ignored raises once more, where Python
            # next looks at signals: entering a function or a call, so nothing is called
            # between the except above and this try, and the steps are taken again.
            for _ in (1, 2, 3):
                try:
                    self._leave_at_once()
                    return
                except KeyboardInterrupt:
                    continue
            return
        self._pool.failures.log.flush()
        if undelivered or self._stop_gave_up:
            logger.warning("hostcallback: %d tap records were not delivered before exit, and the "
                           "taps of computations still running are dropped (waited %.1f s of "
                           "HOSTCALLBACK_EXIT_TIMEOUT=%g s; set it higher to wait longer)",
                           undelivered, time.monotonic() - start, timeout)
        if self._stop_gave_up:
            _leave_backends_to_the_os()
        if self._pool.failures.count:
            logger.error("hostcallback: %d tap consumer(s) raised and no barrier_wait reported it",
                         self._pool.failures.count)

    def _leave_at_once(self) -> None:
        """Exit after a Ctrl-C that said leave: stop the receivers without the rest, say how many
        records are left, let each sink say what it loses. It takes a second or two and must
        run whole, so one more Ctrl-C (a terminal's reaches a wrapper such as `timeout` and the
        program both) is ignored meanwhile. Taken again after a Ctrl-C that came before the
        ignoring began, it says its line once."""
        with _ctrl_c_ignored():
            outfeed.set_leaving()  # computations still running stop at their next tap
            left = self._pool.abandon()
            if not self._said_left:
                self._said_left = True
                sys.stderr.write(f"hostcallback: exit without the {left} queued tap record(s) "
                                 "(Ctrl-C)\n")
            self.run_flush_hooks(time.monotonic())  # no wait: each says what it loses
            if self._pool.computations_running():
                _leave_backends_to_the_os()


def _leave_backends_to_the_os() -> None:
    """Computations still run (stuck, say, in a collective with a process that is gone): XLA's
    client, destroyed as the interpreter finalizes, would wait for their threads for good. One
    reference more to each backend keeps it alive until the process ends."""
    import ctypes

    from jax.extend import backend as jax_backend

    for platform in {device.platform for device in jax.devices()}:
        try:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(jax_backend.get_backend(platform)))
        except Exception:  # noqa: BLE001 - at exit: no backend, nothing to keep
            pass


@contextlib.contextmanager
def _ctrl_c_ignored():
    """SIGINT ignored meanwhile, on the main thread (elsewhere Python runs no handler anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:  # (None: a handler not set from Python; the default then ends the process)
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


# How long exit waits for the receiver threads already past the exit gate to have the GIL.
_EXIT_GATE_SECONDS = 1.0

# How long exit waits, past its deadline, for the barrier's dispatcher to come out of jaxlib once
# the queues are closed: at once when it is idle; 0.05 to 0.4 s after a barrier that gave up, and
# 1.7 to 3.1 s with both cores loaded under AddressSanitizer.
_EXIT_DISPATCHER_SECONDS = 10.0

# How long a fork() waits for the barrier's markers to finish compiling (wait_before_fork).
_FORK_WAIT_SECONDS = 30.0

# A Ctrl-C this recent caused the exit, also where its KeyboardInterrupt became a computation's
# error (raised in a JAX callback) rather than the program's.
_RECENT_CTRL_C_SECONDS = 10.0

# At an exit that Ctrl-C caused: how long a device may show nothing new while a computation that
# began has not ended before exit takes it for one the Ctrl-C failed.
_PRESUMED_FAILED_AFTER_CTRL_C = 1.0

# The value of the markers _compile_markers sends: barriers wait for 4, 8, 12, ... and the next
# value of each, never for 0 or 1.
_UNAWAITED_MARKER = 0

# A probe sums this many elements: XLA's CPU client runs a computation of fewer than 1000
# floating-point operations inline, while it is dispatched, and a probe must not.
_PROBE_ELEMENTS = 4096


def _make_probes(platform_groups: dict[str, list]) -> list[tuple]:
    """A single-device probe per device. (Computations over several devices are launched one
    after another client-wide: the barrier's marker over all devices comes after them.)"""
    single = jax.jit(lambda x: x.sum())
    return [(single, jax.device_put(np.zeros(_PROBE_ELEMENTS, np.float32), device))
            for devices in platform_groups.values() for device in devices]


def _device_of(array) -> Any:
    (device,) = array.devices()
    return device


def _live_results_not_ready() -> list:
    """Every live jax.Array not ready yet: its computation, or one it depends on, still runs
    (and a computation is complete only once its taps were handled)."""
    return [array for array in jax.live_arrays() if not _ready_or_gone(array)]


def _last_counted_lowering() -> float | None:
    """When a computation whose begin counts it on its devices was last lowered (None in the
    portable mode, which has no begin)."""
    if jx.PORTABLE:
        return None
    from hostcallback._trace import fence  # not in the portable mode

    return fence.last_counted_lowering


def _wait_until_ready(arrays: list, deadline: float | None, timeout: float | None,
                      notice: Notice) -> None:
    """Raises TimeoutError at the deadline (monotonic); a failed computation is its owner's to
    see, not the barrier's."""
    pending = [array for array in arrays if not _ready_or_gone(array)]
    pause = _READY_POLL_SECONDS
    while pending:  # polled, never block_until_ready(): a Ctrl-C must be able to end the wait
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimedOut("barrier_wait", timeout, f"{len(pending)} result(s) of "
                               "computations dispatched before it are not ready")
        if notice.due():
            notice.say()
        time.sleep(pause)
        pause = min(2 * pause, _READY_POLL_MAX_SECONDS)
        pending = [array for array in pending if not _ready_or_gone(array)]


def _ready_or_gone(array) -> bool:
    try:
        return array.is_ready()
    except Exception:  # noqa: BLE001 - deleted or failed
        return True


lifecycle = Lifecycle(receivers)
os.register_at_fork(before=lifecycle.wait_before_fork)
