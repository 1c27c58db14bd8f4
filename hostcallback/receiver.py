"""The host side: one receiver thread per local device drains its outfeed queue and calls consumers.

Threads start lazily, the first time a tap is traced. Each waits in C++ with the GIL released,
takes a batch of records already decoded in C++ (numpy views of the records; barrier markers
never reach Python as records), and calls the registered consumer; records of one device are handled
one at a time, in the order the device produced them. A consumer that raises anything, even
SystemExit or KeyboardInterrupt, is logged and remembered; later records still flow, and the next
barrier_wait raises CallbackException (a KeyboardInterrupt is passed on to the main thread
instead). A `call` that fails is reported once, where it failed: its computation gets the error.
A receiver must never die; if one does anyway, its queue is failed in C++ with the reason, so
that every waiting and future tap or call on that device fails, and every barrier raises.

barrier_wait sends marker computations and waits until every device's receiver has handled
them. XLA's CPU client runs single-device computations one after another (client-wide) and
multi-device computations one after another, but the two kinds independently of each other. So
each barrier sends one single-device marker to every device and one marker computation over all
local devices: each kind of computation dispatched before the barrier finished, and its taps
were handled, before the marker of its kind.
"""

from __future__ import annotations

import _thread
import atexit
import itertools
import logging
import queue
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import jax
import numpy as np

from hostcallback import _jax as jx
from hostcallback import batches, config, results, wire
from hostcallback.errors import describe_error
from hostcallback._native import outfeed
from hostcallback.record_context import (
    RecordContext,  # noqa: F401 - its old home
    current_record,  # noqa: F401 - its old home
    for_this_thread,
)
from hostcallback.registry import BARRIER_MARKER_ID, ConsumerRegistry, registry

logger = logging.getLogger("hostcallback")

_DRAIN_RECORDS = 1024
# A batch holds at most this many bytes (or one larger record): large records go one a batch,
# so each returns to the buffer pool as soon as it is delivered.
_DRAIN_BYTES = 1 << 20
# How long drain() waits for a fuller batch: after a first record (_COALESCE_SECONDS), and while
# records come less than _LINGER_SECONDS apart, for the next ones (_LINGER_SECONDS). When each
# wait is made, and why: the comment on DeviceQueue::Pop in _native/outfeed.cc.
_COALESCE_SECONDS = 0.0002
_LINGER_SECONDS = 0.001
_POLL_SECONDS = 0.25
_SUMMARY_SECONDS = 1.0  # repeated failures of one consumer are summarised at most this often
_DRAIN_RETRY_SECONDS = 0.05
_BARRIER_SHARE = 0.8  # of stop()'s (and so of exit's) one deadline
_EXIT_NOTICE_SECONDS = 3.0  # exit says what it waits for once it has waited this long
_ABANDON_JOIN_SECONDS = 1.0  # after a second Ctrl-C, how long exit waits for each receiver
# The portable barrier's fence computations tap marker + 2 (and + 3): values of its own, which
# fit in uint32 (a marker travels as uint32 when x64 is off) and no barrier waits for.
_FENCE_OFFSET = 2

QueueKey = tuple  # (platform, device id): how the C++ core names a device's queue


def queue_key(device: Any) -> QueueKey:
    """Queues are keyed by platform and id: ids repeat across platforms (cpu:0 and gpu:0)."""
    return (device.platform, device.id)


def devices_to_receive(default_devices: list, native_devices: list) -> list:
    """One receiver per device of the default backend, plus one per device our native FFI
    handlers can run on (CPU) when the default backend is another platform, so a CPU tap in a
    GPU process reaches a receiver of its own instead of none (or a GPU device's)."""
    seen, out = set(), []
    for device in [*default_devices, *native_devices]:
        if queue_key(device) not in seen:
            seen.add(queue_key(device))
            out.append(device)
    return out


def _ended_by_ctrl_c() -> bool:
    """The program is ending on an uncaught KeyboardInterrupt (Python sets sys.last_type when it
    prints an uncaught exception, before the exit handlers run)."""
    if hasattr(sys, "ps1"):  # interactive: last_type may be any earlier Ctrl-C of the session
        return False
    last = getattr(sys, "last_type", None)
    return isinstance(last, type) and issubclass(last, KeyboardInterrupt)


def _native_platform_devices() -> list:
    try:
        return jax.local_devices(backend=outfeed.NATIVE_PLATFORM)
    except RuntimeError:  # no CPU backend in this process
        return []


class CallbackException(Exception):
    """A tap consumer raised since the last barrier_wait; ``__cause__`` is the first exception."""


class ReceiverStoppedError(RuntimeError):
    """The receivers were stopped with stop_outfeed_receiver(); taps cannot be delivered any more."""


def _without_locals(error: BaseException) -> BaseException:
    """The error as it is kept for the barrier and the failure log: its traceback without the
    receiver's frame and with the consumer's locals cleared, so that a kept failure does not
    keep the arrays it was called with (and their records) alive."""
    traceback_ = error.__traceback__
    if traceback_ is not None:
        error.__traceback__ = traceback_.tb_next
        traceback.clear_frames(error.__traceback__)
    return error


class _Failure:
    __slots__ = ("consumer_name", "device", "error")

    def __init__(self, consumer_name: str, device: Any, error: BaseException) -> None:
        self.consumer_name, self.device, self.error = consumer_name, device, error

    def describe(self) -> str:
        return f"{self.consumer_name} on {self.device}: {describe_error(self.error)}"


class FailureLog:
    """Logs consumer failures without flooding: the first failure of each consumer in full
    (with its traceback), later ones as a count, summarised at most once a second."""

    def __init__(self, log: logging.Logger, interval_s: float = _SUMMARY_SECONDS) -> None:
        self._log, self._interval = log, interval_s
        self._lock = threading.Lock()
        self._seen: set[tuple] = set()
        self._pending: dict[tuple, list] = {}  # key -> [count, last error, last summary time]

    def failed(self, what: str, name: str, device: Any, error: BaseException,
               consumer_id: int | None = None) -> None:
        """``what`` is "tap consumer" or "call"; each (what, name, consumer_id) is one consumer."""
        key = (what, name, consumer_id)
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
            if not first:
                entry = self._pending.setdefault(key, [0, None, time.monotonic()])
                entry[0] += 1
                entry[1] = error
                due = time.monotonic() - entry[2] >= self._interval
        if first:
            self._log.error("hostcallback: %s %s raised on %s (further failures of it are "
                            "counted, not shown in full)", what, name, device, exc_info=error)
        elif due:
            self.flush(key)

    def flush(self, only: tuple | None = None, *, force: bool = True) -> None:
        """Logs the pending counts (of one consumer, or all); without force only those whose
        last summary is at least the interval old."""
        now = time.monotonic()
        with self._lock:
            due = [(key, entry[0], entry[1]) for key, entry in self._pending.items()
                   if entry[0] and (only is None or key == only)
                   and (force or now - entry[2] >= self._interval)]
            for key, _, _ in due:
                self._pending[key][0] = 0
                self._pending[key][2] = now
        for (what, name, _), count, error in due:
            self._log.error("hostcallback: %s %s raised %d more time(s); latest: %s",
                            what, name, count, describe_error(error))


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


class ReceiverPool:
    """The receiver threads of this process and the bookkeeping barrier_wait needs."""

    def __init__(self, consumers: ConsumerRegistry) -> None:
        self._consumers = consumers
        self._lock = threading.Lock()
        self._marker_seen = threading.Condition(self._lock)
        self._threads: dict[QueueKey, threading.Thread] = {}
        self._devices: dict[QueueKey, Any] = {}
        self._markers: dict[QueueKey, set[int]] = {}
        self._delivered: dict[QueueKey, int] = {}
        self._dead: dict[QueueKey, str] = {}  # receivers that died anyway, and why
        self._failure_log = FailureLog(logger)
        self._first_failure: _Failure | None = None
        self._last_failure: _Failure | None = None
        self._failure_count = 0
        self._next_marker = itertools.count(1)
        self._stopping = threading.Event()
        self._stopped = False
        self._all_started = False  # every receiver is in place (ensure_started's fast path)
        self._exiting = False  # interpreter exit has begun: Ctrl-C in a consumer interrupts no one
        self._abandoned = False  # exit was told to leave the queued records (a second Ctrl-C)
        self._local = threading.local()
        self._flush_hooks: weakref.WeakSet = weakref.WeakSet()
        self._marker_computations: dict[str, tuple] = {}  # per transport, built on first use
        self._batches: dict[QueueKey, list | None] = {}  # each receiver's batch being delivered
        self._contexts: dict[QueueKey, Any] = {}  # each receiver's record context
        self._dispatcher = _Dispatcher()

    # ---- lifecycle ----

    def ensure_started(self) -> None:
        """Starts one receiver per local device, once; refuses after stop_outfeed_receiver().
        The lock-free fast path is taken only once every receiver is in place."""
        if self._all_started and not self._stopped:
            return
        with self._lock:
            if self._stopped:
                raise ReceiverStoppedError(
                    "hostcallback's outfeed receiver was stopped with stop_outfeed_receiver(); "
                    "taps cannot be traced or delivered in this process any more. Stop the "
                    "receiver only at the very end, or start a new process.")
            if self._threads:
                return
            outfeed.set_max_queue_bytes(config.settings.max_queue_bytes)
            for device in devices_to_receive(jax.local_devices(), _native_platform_devices()):
                key = queue_key(device)  # device.id is what XLA hands the FFI handler
                self._devices[key] = device
                self._markers[key] = set()
                self._delivered[key] = 0
                thread = threading.Thread(target=self._receive, args=(key,), daemon=True,
                                          name=f"hostcallback-receiver-{device.platform}"
                                               f"-{device.id}")
                self._threads[key] = thread
                thread.start()
            self._dispatcher.start()
            atexit.register(self._at_exit)
            self._all_started = True

    @property
    def started(self) -> bool:
        return bool(self._threads) and not self._stopped

    @property
    def dead(self) -> bool:
        """A receiver thread died (every barrier then raises, saying why)."""
        return bool(self._dead)

    def stop(self, timeout: float | None = None, notice_after: float | None = None) -> int:
        """Delivers what is queued, then stops the threads; returns how many records were left.
        ``timeout`` bounds the whole stop (barrier and joins together), not each step; with
        ``notice_after``, a stop that has waited that long says on stderr what it waits for."""
        if not self.started:
            self._stopped = self._stopped or bool(self._threads)
            return 0
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # The barrier gets most of the deadline; the rest is for the computations that
            # closing the queues wakes (they fail with "stopped") and for the joins.
            self.barrier_wait(timeout=None if timeout is None else timeout * _BARRIER_SHARE,
                              raise_errors=False, notice_after=notice_after)
        except (TimeoutError, CallbackException) as error:
            logger.warning("hostcallback: %s", error)
        outfeed.set_closed(True)
        self._stopping.set()
        for thread in self._threads.values():  # they deliver what is left, up to the deadline
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._stopped = True
        return self.undelivered()

    def undelivered(self) -> int:
        """Records enqueued on this process's devices that no receiver has handled yet (a batch
        being delivered counts from the record its consumer is at)."""
        with self._lock:
            return self._undelivered_locked()

    def _undelivered_locked(self) -> int:
        return sum(outfeed.stats(k[1], platform=k[0])["records_enqueued"]
                   - self._delivered[k] - self._handled_in_batch(k) for k in self._threads)

    def _handled_in_batch(self, key: QueueKey) -> int:
        batch, context = self._batches.get(key), self._contexts.get(key)
        record = None if context is None else context.record
        if not batch or record is None:
            return 0
        return next((i for i, r in enumerate(batch) if r is record), 0)

    def _at_exit(self) -> None:
        """Delivers what is queued, within HOSTCALLBACK_EXIT_TIMEOUT; a Ctrl-C meanwhile leaves
        the rest (one line says how many), and a receiver finishes at most its batch. A consumer
        that outlasts the deadline may still be running when the interpreter finalizes."""
        self._exiting = True
        timeout = config.settings.exit_timeout_s
        start = time.monotonic()
        deadline = start + timeout
        # After a Ctrl-C the user is waiting to leave: say at once what is left and how to skip it.
        notice_after = 0.0 if _ended_by_ctrl_c() else _EXIT_NOTICE_SECONDS
        try:
            undelivered = self.stop(timeout=timeout, notice_after=notice_after)
        except KeyboardInterrupt:
            left = self._abandon()
            sys.stderr.write(f"hostcallback: exit without the {left} queued tap record(s) "
                             "(Ctrl-C)\n")
            return
        self._run_flush_hooks(deadline)
        self._failure_log.flush()
        if undelivered:
            logger.warning("hostcallback: %d tap records were not delivered before exit (waited "
                           "%.1f s of HOSTCALLBACK_EXIT_TIMEOUT=%g s; set it higher to wait "
                           "longer)", undelivered, time.monotonic() - start, timeout)
        if self._failure_count:
            logger.error("hostcallback: %d tap consumer(s) raised and no barrier_wait reported it",
                         self._failure_count)

    def _abandon(self) -> int:
        """Stops the receivers without delivering the rest; returns how many records were left."""
        self._abandoned = True
        left = self.undelivered()
        outfeed.set_closed(True)
        self._stopping.set()
        for thread in self._threads.values():
            try:
                thread.join(_ABANDON_JOIN_SECONDS)
            except KeyboardInterrupt:  # one more Ctrl-C: leave at once
                break
        self._stopped = True
        return left

    def _say_what_exit_waits_for(self) -> None:
        """One line on stderr; called with the lock held."""
        sys.stderr.write(f"hostcallback: delivering {self._undelivered_locked()} queued tap "
                         "record(s) before exit; press Ctrl-C to leave without them\n")
        sys.stderr.flush()

    # ---- the receiver threads ----

    def _receive(self, key: QueueKey) -> None:
        """The receiver thread: survives anything a consumer or drain() raises; if it dies
        anyway, its queue is failed with the reason, so nothing waits for it forever."""
        try:
            self._local.is_receiver = True
            platform, ordinal = key
            device = self._devices[key]
            context = for_this_thread()
            context.device = device
            self._contexts[key] = context
            while True:
                try:
                    batch, markers = outfeed.drain(ordinal, _DRAIN_RECORDS, _DRAIN_BYTES,
                                                   _POLL_SECONDS, platform=platform,
                                                   coalesce_s=_COALESCE_SECONDS,
                                                   linger_s=_LINGER_SECONDS)
                except Exception as error:  # noqa: BLE001 - e.g. MemoryError; records not yet
                    # taken stay queued, a batch already taken is lost (the barrier says why)
                    self._record_failure("receiver", "drain()", device, error)
                    if self._stopping.is_set():  # stop() joins us: a failing drain ends here
                        return
                    time.sleep(_DRAIN_RETRY_SECONDS)
                    continue
                if batch and not self._abandoned:
                    self._batches[key] = batch  # for undelivered(), while it is delivered
                    self._deliver(key, device, batch)
                    self._batches[key] = None
                if markers or batch:
                    with self._lock:
                        self._delivered[key] += len(batch)  # markers are counted apart
                        if markers:
                            self._markers[key].update(markers)
                            self._marker_seen.notify_all()
                # The queues are closed before _stopping is set, so an empty batch means done.
                elif self._stopping.is_set():
                    return
                del batch
        except BaseException as error:  # noqa: BLE001 - reported through _receiver_died
            self._receiver_died(key, error)

    def _receiver_died(self, key: QueueKey, error: BaseException) -> None:
        reason = (f"hostcallback: the receiver for {self._devices.get(key, key)} died "
                  f"({type(error).__name__}: {error}); its taps and calls cannot be delivered "
                  f"in this process any more")
        with self._lock:
            self._dead[key] = reason
            self._marker_seen.notify_all()
        outfeed.fail(key[1], reason, platform=key[0])
        logger.critical("%s", reason, exc_info=error)

    def _record_failure(self, what: str, name: str, device: Any, error: BaseException,
                        report_at_barrier: bool = True, consumer_id: int | None = None) -> None:
        """Keeps the failure for the next barrier, then logs it; a logging handler that raises
        loses the log line, never the failure or the receiver."""
        if report_at_barrier:
            failure = _Failure(name, device, error)
            with self._lock:
                self._failure_count += 1
                self._first_failure = self._first_failure or failure
                self._last_failure = failure
        try:
            self._failure_log.failed(what, name, device, error, consumer_id)
        except Exception:  # noqa: BLE001 - a user's logging handler; nothing else to tell
            pass

    def _deliver(self, key: QueueKey, device: Any, batch: list) -> None:
        """Calls the consumer of each record of a batch, in order. The per-record path is a
        dict lookup, an unflatten and the call: the records come decoded from C++, the
        consumer's context is built only if it asks (current_record()), and the delivered
        count is kept per batch by the caller. A tap function with ``tap_batch`` gets each run
        of its records in one call (hostcallback.batches)."""
        consumers = self._consumers.by_id
        current = for_this_thread()
        index, count = 0, len(batch)
        while index < count:
            record = batch[index]  # (consumer_id, device, sequence, flags, arrays or why not)
            index += 1
            try:
                consumer = consumers.get(record[0]) or self._consumers.get(record[0])
                if record[4].__class__ is str:
                    raise wire.UndecodableRecordError(
                        f"a tap record could not be decoded: {record[4]}")
                if consumer.tap_batch is not None:  # its whole run of records in one call
                    start, index = index - 1, batches.run_end(batch, index - 1)
                    current.record = record
                    consumer.tap_batch(batches.RecordBatch(batch, start, index, consumer, device))
                    current.record = None
                elif consumer.is_call:
                    current.record = record
                    result = consumer.call(record[4], device)
                    current.record = None
                    if record[3] & wire.FLAG_EXPECTS_RESPONSE:
                        outfeed.respond(key[1], record[2], results.result_leaves(consumer, result),
                                        platform=key[0])
                else:  # a tap: this record and the rest of its run in one tight loop
                    deliver, end = consumer.deliver, batches.run_end(batch, index - 1)
                    current.record = record
                    deliver(record[4], device)
                    while index < end:
                        record = batch[index]
                        index += 1
                        current.record = record
                        deliver(record[4], device)
                    current.record = None
            except BaseException as error:  # noqa: BLE001 - nothing a consumer raises stops us
                current.record = None  # the loop goes on after the record that failed
                self._consumer_failed(key, device, record, _without_locals(error))
                current.record = None  # clearing the frames may close a batch's values()
        # A kept failure's traceback reaches this frame (its frames' f_back): let go of the batch.
        batch = record = None

    def _consumer_failed(self, key: QueueKey, device: Any, record: tuple,
                         error: BaseException) -> None:
        platform, ordinal = key
        consumer_id, _, sequence, flags, _ = record
        consumer = self._consumers.by_id.get(consumer_id)
        consumer_name = (f"<unknown consumer {consumer_id}>" if consumer is None else
                         consumer.name or getattr(consumer.func, "__name__", repr(consumer.func)))
        is_call = bool(flags & wire.FLAG_EXPECTS_RESPONSE)
        if is_call:
            # The device is waiting: fail its call with the reason, keep the process alive.
            # That is where the failure is reported, once: not again at the next barrier.
            outfeed.respond_error(ordinal, sequence,
                                  f"hostcallback call consumer {consumer_name} failed: "
                                  f"{describe_error(error)}", platform=platform)
        if isinstance(error, KeyboardInterrupt) and not self._exiting:
            _thread.interrupt_main()  # the user pressed Ctrl-C: the main thread must see it
        self._record_failure("call" if is_call else "tap consumer", consumer_name, device,
                             error, report_at_barrier=not is_call
                             and not isinstance(error, KeyboardInterrupt),
                             consumer_id=consumer_id)

    # ---- barrier ----

    def barrier_wait(self, logging_name: str | None = None, timeout: float | None = None,
                     raise_errors: bool = True, notice_after: float | None = None) -> None:
        if getattr(self._local, "is_receiver", False):
            raise RuntimeError(
                "barrier_wait() was called from inside a tap consumer; it would wait for itself. "
                "Call it from the code that runs the computation instead.")
        if jx.is_tracing():
            raise RuntimeError(
                "barrier_wait() was called while tracing (inside jit, vmap, grad, ...); it waits "
                "on the host for taps and cannot be part of a computation. Call it after the "
                "computation, outside any transformation.")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.started:
            self._raise_if_dead()
            self._wait_for_markers(logging_name, timeout, notice_after)
        self._run_flush_hooks(deadline)
        self._failure_log.flush(force=False)
        if raise_errors:
            self._raise_failures()

    def add_flush_hook(self, owner) -> None:
        """Calls ``owner.flush()`` after every barrier and at exit, for as long as owner lives
        (sinks that buffer use it so that a barrier also means 'on disk')."""
        self._flush_hooks.add(owner)

    def _run_flush_hooks(self, deadline: float | None = None) -> None:
        """Flushes every hook; one that can bound its wait (``flush_before``, e.g. SocketSink)
        gets the caller's deadline (monotonic), so a barrier's timeout and exit bound it too."""
        for owner in list(self._flush_hooks):
            try:
                flush_before = getattr(owner, "flush_before", None)
                if flush_before is not None:
                    flush_before(deadline)
                    continue
                owner.flush()
            except Exception:
                logger.exception("hostcallback: flushing %r failed", owner)

    def _raise_if_dead(self) -> None:
        with self._lock:
            self._raise_if_dead_locked()

    def _raise_if_dead_locked(self) -> None:
        if self._dead:
            raise CallbackException("; ".join(self._dead.values()))

    def _wait_for_markers(self, logging_name: str | None, timeout: float | None,
                          notice_after: float | None = None) -> None:
        with self._lock:
            marker = 4 * next(self._next_marker)  # marker, marker + 1; fences marker + 2, + 3
        grouped = self._platform_groups()
        expected = {key: {marker, marker + 1} if len(grouped[key[0]]) > 1 else {marker}
                    for key in self._devices}
        if logging_name:
            logger.debug("hostcallback: barrier %s (marker %d) starts", logging_name, marker)
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
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
                    with self._lock:
                        self._marker_seen.notify_all()

            sent = self._dispatcher.submit(send)
        with self._lock:
            try:
                while True:
                    self._raise_if_dead_locked()
                    if send_errors:
                        raise send_errors[0]
                    behind = [k for k in self._devices if not expected[k] <= self._markers[k]]
                    if not behind:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        pending = {str(self._devices[k]):
                                   outfeed.stats(k[1], platform=k[0])["records_enqueued"]
                                   - self._delivered[k] for k in behind}
                        raise TimeoutError(
                            f"barrier_wait{f' ({logging_name})' if logging_name else ''} timed "
                            f"out after {timeout} s; records still to be handled per device: "
                            f"{pending}. A consumer may be slow or stuck.")
                    if notice_after is not None and time.monotonic() - started >= notice_after:
                        notice_after = None
                        self._say_what_exit_waits_for()
                        continue
                    wait = remaining if remaining is not None else _POLL_SECONDS
                    if notice_after is not None:  # wake in time to say it
                        wait = min(wait, _POLL_SECONDS)
                    self._marker_seen.wait(wait)
            finally:
                for seen in self._markers.values():
                    seen.difference_update(range(marker, marker + 4))
        if sent is not None:
            # Its markers arrived, so its dispatches are done: let it return before we do (a
            # thread still inside jaxlib when the interpreter exits aborts the process).
            sent.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if logging_name:
            logger.debug("hostcallback: barrier %s (marker %d) done", logging_name, marker)

    def _platform_groups(self) -> dict[str, list]:
        groups: dict[str, list] = {}
        for (platform, _), device in self._devices.items():
            groups.setdefault(platform, []).append(device)
        return groups

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
        """The portable mode's barrier: once JAX's effects barrier has seen every computation
        dispatched so far finish (their taps are then queued), a marker enqueued from the host
        comes after all of them, on every device (``marker + 1`` too where a barrier expects
        two)."""
        try:
            jax.effects_barrier()
        except Exception:  # noqa: BLE001 - a computation failed (its caller was told); JAX
            # raises that again at every later effects barrier without waiting for the rest,
            # so marker computations on every device wait for what was dispatched before.
            with jx.outside_user_mesh():
                self._send_markers_outside_user_mesh(marker + _FENCE_OFFSET)
        grouped = self._platform_groups()
        for (platform, ordinal) in self._devices:
            values = [marker, marker + 1] if len(grouped[platform]) > 1 else [marker]
            for value in values:
                outfeed.enqueue(ordinal, BARRIER_MARKER_ID,
                                [wire.as_leaf(np.array(value, dtype=np.uint64))],
                                platform=platform)

    def _send_markers_outside_user_mesh(self, marker: int) -> None:
        from hostcallback import binding, transport

        # The markers travel by the transport in use now, as the taps they wait for do.
        transport_name = transport.default_transport()
        if transport_name not in self._marker_computations:

            def tap_marker(x):
                return binding.bind([x], consumer_id=BARRIER_MARKER_ID, transport=transport_name)

            all_devices_markers = []
            for devices in self._platform_groups().values():
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
                for device in self._devices.values()]
        for computation, sharding, count in all_devices_markers:
            markers = np.full(count, marker + 1, dtype=np.uint64)
            outs.append(computation(jax.device_put(markers, sharding)))
        # A marker arrives before its computation has finished (on the callback transport, before
        # XLA's thread has left our callback and Python): the barrier ends only once they have,
        # so that exit never lets finalization begin with one of them still inside Python.
        jax.block_until_ready(outs)

    def _raise_failures(self) -> None:
        with self._lock:
            first, last, count = self._first_failure, self._last_failure, self._failure_count
            self._first_failure, self._last_failure, self._failure_count = None, None, 0
        if first is None:
            return
        message = "There were exceptions during callback processing. " \
                  f"{count} tap consumer call(s) raised since the last barrier_wait; first: " \
                  f"{first.describe()}"
        if count > 1:
            message += f"; last: {last.describe()}"
        raise CallbackException(message) from first.error

    # ---- statistics ----

    def _known_devices(self) -> dict[QueueKey, Any]:
        return self._devices or {queue_key(d): d for d in devices_to_receive(
            jax.local_devices(), _native_platform_devices())}

    def queue_stats(self) -> dict[Any, dict[str, Any]]:
        """Per local device: the native queue's counters plus records handled by the receiver;
        ``calls_waiting``/``answers_unclaimed`` count `call`s waiting for the host's answer and
        answers not yet taken (both return to zero once the calls end)."""
        out = {}
        for (platform, ordinal), device in self._known_devices().items():
            stats = dict(outfeed.stats(ordinal, platform=platform))
            stats["records_handled"] = self._delivered.get((platform, ordinal), 0)
            out[device] = stats
        return out

    def reset_peak_bytes_queued(self) -> None:
        """Starts every device's ``peak_bytes_queued`` again from what is queued now."""
        for platform, ordinal in self._known_devices():
            outfeed.reset_peak_bytes_queued(ordinal, platform=platform)


receivers = ReceiverPool(registry)


def reset_peak_bytes_queued() -> None:
    """Starts every local device's ``peak_bytes_queued`` (see queue_stats()) again from what is
    queued now, so that a check of the peak covers only what runs after it."""
    receivers.reset_peak_bytes_queued()
