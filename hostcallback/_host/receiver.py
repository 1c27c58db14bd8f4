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

Starting, barriers and stopping are lifecycle.py's; consumer failures are kept in failures.py.
"""

from __future__ import annotations

import _thread
import logging
import os
import sys
import threading
import time
from typing import Any

import jax

from hostcallback import config
from hostcallback._host import batches, results
from hostcallback._host.failures import CallbackException, Failures, without_locals
from hostcallback._host.record_context import for_this_thread
from hostcallback._native import outfeed
from hostcallback._records import handover, wire
from hostcallback._records.record_layout import CONSUMER_ID, FLAGS, LEAVES, SEQUENCE
from hostcallback._records.registry import ConsumerRegistry, registry
from hostcallback.errors import (
    ReceiverStoppedError,
    UndecodableRecordError,
    WaitTimedOut,
    describe_error,
    name_of,
    printable,
)

logger = logging.getLogger("hostcallback")

_DRAIN_RECORDS = 1024
# A batch holds at most this many bytes (or one larger record): large records go one a batch,
# so each returns to the buffer pool as soon as it is delivered.
_DRAIN_BYTES = 1 << 20
# How long drain() waits for a fuller batch: after a first record (_COALESCE_SECONDS), and while
# records come less than _LINGER_SECONDS apart, for the next ones (_LINGER_SECONDS). When each
# wait is made, and why: the comment on DeviceQueue::Pop in _native/device_queue.h.
_COALESCE_SECONDS = 0.0002
_LINGER_SECONDS = 0.001
_POLL_SECONDS = 0.25
_COMPUTATIONS_POLL_SECONDS = 0.001
# How long after a tapped computation was lowered a barrier that finds no device running one
# yet waits for its first run to begin (wait_for_computations).
_RECENT_LOWERING_SECONDS = 30.0
# A tapped computation that began before a barrier and whose device then shows nothing new for
# this long is taken for failed where none of our handlers saw it (its fence never runs).
_PRESUMED_FAILED_SECONDS = 10.0
_DRAIN_RETRY_SECONDS = 0.05
_ABANDON_JOIN_SECONDS = 1.0  # after a second Ctrl-C, how long exit waits for each receiver

QueueKey = tuple  # (platform, device id): how the C++ core names a device's queue


def queue_key(device: Any) -> QueueKey:
    """Queues are keyed by platform and id: ids repeat across platforms (cpu:0 and gpu:0)."""
    return (device.platform, device.id)


def devices_to_receive(default_devices: list, native_devices: list) -> list:
    """One receiver per device of the default backend, plus one per device our native FFI
    handlers can run on (CPU, CUDA GPUs) on another platform, so a CPU tap in a GPU process, or
    a GPU tap where the CPU is the default backend, reaches a receiver of its own instead of
    none (or another device's)."""
    seen, out = set(), []
    for device in [*default_devices, *native_devices]:
        if queue_key(device) not in seen:
            seen.add(queue_key(device))
            out.append(device)
    return out


def cuda_device_ids(devices: list) -> list[int]:
    """The global id of each local CUDA device by its ordinal (``local_hardware_id``, what XLA
    hands the GPU tap handler), -1 where an ordinal is not among them."""
    ordinals = {d.local_hardware_id: d.id for d in devices
                if d.platform == "gpu" and d.local_hardware_id is not None}
    return [ordinals.get(i, -1) for i in range(max(ordinals, default=-1) + 1)]


def _native_platform_devices() -> list:
    """The local devices of each platform our native handlers serve that this process has."""
    devices = []
    for backend in (outfeed.NATIVE_PLATFORM, "cuda"):
        try:
            devices += jax.local_devices(backend=backend)
        except RuntimeError:  # no such backend in this process
            pass
    return devices


def _name_of(consumer: Any) -> str:
    """How logs and errors name a consumer: its name, else its function's."""
    return consumer.name or name_of(consumer.func)


class Notice:
    """Says once, on stderr, what a long wait waits for, once it has lasted ``after`` seconds
    (None: never)."""

    def __init__(self, after: float | None, say) -> None:
        self._at = None if after is None else time.monotonic() + after
        self._say = say

    @property
    def pending(self) -> bool:
        return self._at is not None

    def due(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    def say(self) -> None:
        self._at = None
        self._say()


FORKED = ("hostcallback's receivers were started in the process this one is a fork() of, and "
          "threads do not come along: taps and calls cannot be traced or delivered here. Start "
          "worker processes with multiprocessing's \"spawn\" or \"forkserver\" method, or "
          "tap in the parent only.")


class ReceiverPool:
    """The receiver threads of this process, what they delivered, and the barrier markers they
    have seen."""

    def __init__(self, consumers: ConsumerRegistry) -> None:
        self._consumers = consumers
        # Reentrant for its owner check: a wait that a Ctrl-C interrupted releases it only if it
        # still holds it (_release_if_held).
        self._lock = threading.RLock()
        self._marker_seen = threading.Condition(self._lock)
        self._threads: dict[QueueKey, threading.Thread] = {}
        self._devices: dict[QueueKey, Any] = {}
        self._markers: dict[QueueKey, set[int]] = {}
        self._delivered: dict[QueueKey, int] = {}
        self._dead: dict[QueueKey, str] = {}  # receivers that died anyway, and why
        self.failures = Failures(logger)
        self._stopping = threading.Event()
        self._stopped = False
        self._all_started = False  # every receiver is in place (ensure_started's fast path)
        self.exiting = False  # interpreter exit has begun: Ctrl-C in a consumer interrupts no one
        self._abandoned = False  # exit was told to leave the queued records (a second Ctrl-C)
        self._left_when_abandoned: int | None = None  # how many records abandon() left
        self.forked = False  # this process is a fork() child of the one that started them
        # How long a device that shows nothing new may hold a computation that began and never
        # ended before waits take it for failed (shorter at an exit that Ctrl-C caused).
        self.presumed_failed_s = _PRESUMED_FAILED_SECONDS
        self._local = threading.local()
        self._batches: dict[QueueKey, list | None] = {}  # each receiver's batch being delivered
        self._contexts: dict[QueueKey, Any] = {}  # each receiver's record context

    # ---- starting and stopping ----

    def start(self) -> bool:
        """Starts one receiver per local device, once (True when this call started them);
        refuses after stop_outfeed_receiver(). The lock-free fast path is taken only once every
        receiver is in place."""
        if self._all_started and not self._stopped:
            return False
        if self.forked:
            raise ReceiverStoppedError(FORKED)
        with self._lock:
            if self._stopped:
                raise ReceiverStoppedError(
                    "hostcallback's outfeed receiver was stopped with stop_outfeed_receiver(); "
                    "taps cannot be traced or delivered in this process any more. Stop the "
                    "receiver only at the very end, or start a new process.")
            if self._threads:
                return False
            outfeed.set_max_queue_bytes(config.settings.max_queue_bytes)
            native_devices = _native_platform_devices()
            outfeed.set_cuda_device_ids(cuda_device_ids(native_devices))
            # device.id is what XLA hands the FFI handler. The tables are replaced whole, never
            # grown in place: other threads read them without the lock (queue_stats(), a
            # barrier that begins as the receivers start), and a dict that grows while they
            # iterate over it raises.
            devices = {queue_key(device): device
                       for device in devices_to_receive(jax.local_devices(), native_devices)}
            self._markers = {**self._markers, **{key: set() for key in devices}}
            self._delivered = {**self._delivered, **dict.fromkeys(devices, 0)}
            self._devices = {**self._devices, **devices}
            for key, device in devices.items():
                thread = threading.Thread(target=self._receive, args=(key,), daemon=True,
                                          name=f"hostcallback-receiver-{device.platform}"
                                               f"-{device.id}")
                try:
                    thread.start()
                except RuntimeError as error:  # Python 3.12+ during interpreter exit
                    self._stopped = self._stopped or bool(self._threads)
                    raise ReceiverStoppedError(
                        "hostcallback cannot start its receiver threads: the interpreter is "
                        f"exiting ({error}), since the main thread ended while another thread "
                        "went on tapping. Start them before it ends: trace the tapping code "
                        "once on the main thread (for example jax.jit(step).lower(...)), or "
                        "join the thread that taps before the script ends.") from error
                self._threads = {**self._threads, key: thread}
            self._all_started = True
            return True

    def forked_in_child(self) -> None:
        """os.register_at_fork's child handler: the child's copy of the pool has no threads, so
        it is stopped, without a lock (one may have been held at the fork) and without the exit
        work that is its parent's (a barrier, and flushing sinks whose buffers the parent
        flushes too)."""
        if self._threads:
            self.forked = True
            self._stopped = True

    @property
    def started(self) -> bool:
        return bool(self._threads) and not self._stopped

    @property
    def dead(self) -> bool:
        """A receiver thread died (every barrier then raises, saying why)."""
        return bool(self._dead)

    def mark_stopped(self) -> None:
        """A stop while no receiver runs: receivers stopped before stay stopped (later taps are
        refused); if none ever started, nothing changes and a later tap starts them."""
        self._stopped = self._stopped or bool(self._threads)

    def close(self, deadline: float | None) -> int:
        """Closes the queues and joins the receivers, which deliver what is left up to the
        deadline (monotonic); returns how many records were left."""
        outfeed.set_closed(True)
        self._stopping.set()
        for thread in self._threads.values():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._stopped = True
        self._forget_queues_of_ended_receivers()
        return self.undelivered()

    def is_receiver_thread(self) -> bool:
        return getattr(self._local, "is_receiver", False)

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

    def abandon(self) -> int:
        """Stops the receivers without delivering the rest; returns how many records were left
        (counted by the first call: a second one, after a Ctrl-C cut the first short, says the
        same)."""
        if self._left_when_abandoned is None:
            self._left_when_abandoned = self.undelivered()
        left = self._left_when_abandoned
        self._abandoned = True
        outfeed.set_closed(True)
        self._stopping.set()
        for thread in self._threads.values():
            try:
                thread.join(_ABANDON_JOIN_SECONDS)
            except KeyboardInterrupt:  # one more Ctrl-C: leave at once
                break
        self._stopped = True
        self._forget_queues_of_ended_receivers()
        return left

    def _forget_queues_of_ended_receivers(self) -> None:
        """After a stop: what a receiver that has ended left queued is never drained, so the
        arrays its handed-over taps stand for are let go (a receiver still in a consumer past
        the deadline drains the rest of its queue when it returns)."""
        for key, thread in self._threads.items():
            if not thread.is_alive():
                handover.forget_queue(*key)

    def computations_running(self) -> int:
        """Tapped computations begun and not ended, on every device."""
        return sum(outfeed.computations(k[1], platform=k[0])["running"] for k in self._threads)

    def say_what_is_waited_for(self) -> None:
        """One line on stderr: the tapped computations still running and the records queued;
        nothing when there are neither (the wait is about to end)."""
        running = self.computations_running()
        with self._lock:
            queued = self._undelivered_locked()
        if not running and not queued:
            return
        sys.stderr.write(f"hostcallback: waiting for {running} tapped computation(s) still "
                         f"running and delivering {queued} queued tap record(s) before exit; "
                         "press Ctrl-C to leave without them\n")
        sys.stderr.flush()

    # ---- the receiver threads ----

    def _receive(self, key: QueueKey) -> None:
        """The receiver thread: survives anything a consumer or drain() raises; if it dies
        anyway, its queue is failed with the reason, so nothing waits for it forever."""
        try:
            self._local.is_receiver = True
            outfeed.mark_receiver_thread()  # it parks at the exit gate (lifecycle's exit)
            platform, ordinal = key
            device = self._devices[key]
            context = for_this_thread()
            context.device = device
            self._contexts[key] = context
            stopping_seen = False
            while True:
                try:
                    batch, markers = outfeed.drain(ordinal, _DRAIN_RECORDS, _DRAIN_BYTES,
                                                   _POLL_SECONDS, platform=platform,
                                                   coalesce_s=_COALESCE_SECONDS,
                                                   linger_s=_LINGER_SECONDS)
                except Exception as error:  # noqa: BLE001 - e.g. MemoryError; records not yet
                    # taken stay queued, a batch already taken is lost (the barrier says why)
                    # and its barrier markers come with the next drain
                    self.failures.record("receiver", "drain()", device, error)
                    if self._stopping.is_set():  # stop() joins us: a failing drain ends here
                        return
                    time.sleep(_DRAIN_RETRY_SECONDS)
                    continue
                lost = False
                try:
                    batch = handover.with_tap_arrays(batch)
                except Exception as error:  # noqa: BLE001 - the batch is lost (the barrier says
                    # why), its markers are not: a barrier waiting for them ends with the error
                    self.failures.record("receiver", "drain()", device, error)
                    handover.forget_batch(batch)
                    lost = True
                if batch and not self._abandoned and not lost:
                    self._batches[key] = batch  # for undelivered(), while it is delivered
                    self._deliver(key, device, batch)
                    self._batches[key] = None
                if markers or batch:
                    with self._lock:
                        # (a lost batch counts too: its error is what the barrier reports)
                        self._delivered[key] += len(batch)  # markers are counted apart
                        if markers:
                            self._markers[key].update(markers)
                            self._marker_seen.notify_all()
                # The queues are closed before _stopping is set, and a closed queue hands out
                # what it holds at once: an empty batch from a drain that began after _stopping
                # was seen means done (one from before may have missed a record that joined
                # before the close).
                elif self._stopping.is_set():
                    if stopping_seen:
                        return
                    stopping_seen = True
                del batch
        except BaseException as error:  # noqa: BLE001 - reported through _receiver_died
            self._receiver_died(key, error)

    def _receiver_died(self, key: QueueKey, error: BaseException) -> None:
        reason = (f"hostcallback: the receiver for {self._devices.get(key, key)} died "
                  f"({describe_error(error)}); its taps and calls cannot be delivered "
                  f"in this process any more")
        with self._lock:
            self._dead[key] = reason
            self._marker_seen.notify_all()
        outfeed.fail(key[1], reason, platform=key[0])
        handover.forget_queue(*key)  # nothing drains its queue any more
        logger.critical("%s", reason, exc_info=error)

    def _deliver(self, key: QueueKey, device: Any, batch: list) -> None:
        """Calls the consumer of each record of a batch, in order. The per-record path is a
        dict lookup, an unflatten and the call: the records come decoded from C++, the
        consumer's context is built only if it asks (current_record()), and the delivered
        count is kept per batch by the caller. A tap function with ``tap_batch`` gets each run
        of its records in one call (hostcallback._host.batches)."""
        consumers = self._consumers.by_id
        current = for_this_thread()
        index, count = 0, len(batch)
        while index < count:
            record = batch[index]  # (consumer_id, device, sequence, flags, arrays or why not)
            index += 1
            try:
                consumer = (consumers.get(record[CONSUMER_ID])
                            or self._consumers.get(record[CONSUMER_ID]))
                if record[LEAVES].__class__ is str:
                    raise UndecodableRecordError(
                        f"a tap record could not be decoded: {record[LEAVES]}")
                if consumer.tap_batch is not None:  # its whole run of records in one call
                    start, index = index - 1, batches.run_end(batch, index - 1)
                    current.record = record
                    consumer.tap_batch(batches.RecordBatch(batch, start, index, consumer, device))
                    current.record = None
                elif consumer.is_call and record[FLAGS] & wire.FLAG_HANDED_OVER_IN_PYTHON:
                    ticket = handover.ticket_of(record[LEAVES])
                    arguments = handover.arguments(ticket)
                    if arguments is None:  # its caller gave up: nobody waits for an answer
                        self._call_not_run(consumer, device)
                        continue
                    current.record = record
                    result = consumer.invoke(arguments, device)
                    current.record = None
                    handover.respond(key[0], key[1], record[SEQUENCE], ticket,
                                     results.result_leaves(consumer, result))
                elif consumer.is_call:
                    if (record[FLAGS] & wire.FLAG_EXPECTS_RESPONSE and not outfeed.call_waiting(
                            key[1], record[SEQUENCE], platform=key[0])):
                        self._call_not_run(consumer, device)  # its caller gave up already
                        continue
                    current.record = record
                    result = consumer.invoke(record[LEAVES], device)
                    current.record = None
                    if record[FLAGS] & wire.FLAG_EXPECTS_RESPONSE:
                        outfeed.respond(key[1], record[SEQUENCE],
                                        results.result_leaves(consumer, result),
                                        platform=key[0])
                else:  # a tap: this record and the rest of its run in one tight loop
                    deliver, end = consumer.deliver, batches.run_end(batch, index - 1)
                    current.record = record
                    deliver(record[LEAVES], device)
                    while index < end:
                        record = batch[index]
                        index += 1
                        current.record = record
                        deliver(record[LEAVES], device)
                    current.record = None
            except BaseException as error:  # noqa: BLE001 - nothing a consumer raises stops us
                current.record = None  # the loop goes on after the record that failed
                self._consumer_failed(key, device, record, without_locals(error))
                current.record = None  # clearing the frames may close a batch's values()
        # A kept failure's traceback reaches this frame (its frames' f_back): let go of the batch.
        batch = record = None

    @staticmethod
    def _call_not_run(consumer: Any, device: Any) -> None:
        """A call whose caller stopped waiting (it timed out, was interrupted or was stopped)
        before its function could run: the function is not run; its caller has already failed
        with the reason."""
        logger.warning("hostcallback: call %s on %s was not run: its caller stopped waiting (it "
                       "timed out, was interrupted or was stopped) before it could run",
                       _name_of(consumer), device)

    def _consumer_failed(self, key: QueueKey, device: Any, record: tuple,
                         error: BaseException) -> None:
        platform, ordinal = key
        consumer_id, _, sequence, flags, _ = record
        consumer = self._consumers.by_id.get(consumer_id)
        consumer_name = (f"<unknown consumer {consumer_id}>" if consumer is None else
                         _name_of(consumer))
        is_call = bool(flags & wire.FLAG_EXPECTS_RESPONSE)
        if is_call:
            # The device is waiting: fail its call with the reason, keep the process alive.
            # That is where the failure is reported, once: not again at the next barrier.
            outfeed.respond_error(ordinal, sequence,
                                  printable(f"hostcallback call consumer {consumer_name} failed: "
                                            f"{describe_error(error)}"), platform=platform)
        if not is_call and consumer is not None and consumer.fails_computation:
            # Reported by the computation it fails, and at the barrier too: a computation
            # without results, which nobody waits for, would lose it.
            why = f"hostcallback: {consumer_name} raised on {device}: {describe_error(error)}"
            outfeed.fail_tap_computation(ordinal, sequence, printable(why), platform=platform)
        if isinstance(error, KeyboardInterrupt) and not self.exiting:
            _thread.interrupt_main()  # the user pressed Ctrl-C: the main thread must see it
        self.failures.record("call" if is_call else "tap consumer", consumer_name, device,
                             error, report_at_barrier=not is_call
                             and not isinstance(error, KeyboardInterrupt),
                             consumer_id=consumer_id)

    # ---- barrier markers ----

    @property
    def devices(self) -> dict[QueueKey, Any]:
        return self._devices

    def raise_if_dead(self) -> None:
        with self._lock:
            self._raise_if_dead_locked()

    def _raise_if_dead_locked(self) -> None:
        if self._dead:
            raise CallbackException("; ".join(self._dead.values()))

    def wake_waiters(self) -> None:
        with self._lock:
            self._marker_seen.notify_all()

    def wait_for_markers(self, expected: dict[QueueKey, set[int]], markers: range,
                         deadline: float | None, *, send_errors: list, what: str,
                         timeout: float | None, notice: Notice | None) -> None:
        """Waits until each device's receiver has seen its ``expected`` markers, then forgets
        every marker in ``markers``. Raises the first of ``send_errors`` (appended by the
        thread sending the markers, which then calls wake_waiters()), CallbackException when a
        receiver died, and TimeoutError at the deadline (monotonic); a ``notice`` that comes due
        meanwhile is said."""
        self._lock.acquire()
        try:
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
                        raise WaitTimedOut(
                            what, timeout, f"records still to be handled per device: "
                            f"{pending}. A consumer may be slow or stuck.")
                    if notice is not None and notice.due():
                        self._lock.release()  # saying it reads the queues' stats
                        try:
                            notice.say()
                        finally:
                            self._lock.acquire()
                        continue
                    wait = remaining if remaining is not None else _POLL_SECONDS
                    if notice is not None and notice.pending:  # wake in time to say it
                        wait = min(wait, _POLL_SECONDS)
                    self._marker_seen.wait(wait)
            finally:
                for seen in self._markers.values():
                    seen.difference_update(markers)
        finally:
            _release_if_held(self._lock)

    def computations_begun(self) -> dict[QueueKey, int]:
        """Per device, how many tapped computations have begun (the id the next one gets)."""
        return {key: outfeed.computations(key[1], platform=key[0])["begun"]
                for key in self._devices}

    def wait_for_computations(self, begun: dict[QueueKey, int], deadline: float | None, *,
                              follow_s: float, followed: int, timeout: float | None,
                              notice: Notice | None = None, lowered_at: float | None = None,
                              first_begin_s: float = 0.0) -> None:
        """Waits until every tapped computation that had begun (``begun``, from
        computations_begun()) has ended, its taps handled. Then follows those that begin within
        ``follow_s`` of one ending, at most ``followed`` more per device: a computation already
        dispatched, waiting for the results that just completed, begins that soon. Where no
        device has run a tapped computation since one was lowered (``lowered_at``, monotonic,
        within _RECENT_LOWERING_SECONDS), it first waits up to ``first_begin_s`` (and half
        the time to the deadline) for one to begin: a computation's first run can begin well
        after its dispatch, and one dispatched from another thread is known only once it
        begins. Raises TimeoutError at the deadline while a begun computation runs, and
        CallbackException when a receiver died."""
        limit = {key: count + followed for key, count in begun.items()}
        last_seen: dict[QueueKey, tuple] = {}  # what each device last showed, and since when
        # The wait for a first run, a guess, takes at most half the time a deadline leaves.
        started = time.monotonic()
        first_begin_until = started + first_begin_s
        if deadline is not None:
            first_begin_until = min(first_begin_until, started + (deadline - started) / 2)
        while True:
            self.raise_if_dead()
            shown = {key: outfeed.computations(key[1], platform=key[0]) for key in begun}
            # A guess: it ends at the deadline without an error.
            awaiting_first_run = (time.monotonic() < first_begin_until
                                  and self._none_ran_since(lowered_at, begun, shown))
            waiting = []
            for key, count in begun.items():
                now = shown[key]
                before = now["oldest_running"] < count
                if before and self._stalled(key, now, last_seen):
                    abandoned = outfeed.abandon_computations(key[1], count, platform=key[0])
                    logger.warning(
                        "hostcallback: %d tapped computation(s) on %s began and, with nothing "
                        "happening on that device for %g s, never reached their end: taken for "
                        "failed (an error outside hostcallback's handlers, such as a JAX "
                        "callback that raised); barriers no longer wait for them", abandoned,
                        self._devices[key], self.presumed_failed_s)
                    continue
                following = now["oldest_running"] < limit[key] and (
                    now["running"] > 0 or 0 <= now["seconds_since_end"] < follow_s)
                if before or following:
                    waiting.append(key)
            if not waiting and not awaiting_first_run:
                return
            if deadline is not None and time.monotonic() >= deadline:
                if not waiting:
                    return
                raise WaitTimedOut(
                    "barrier_wait", timeout, "tapped computations still running on "
                    f"{[str(self._devices[k]) for k in waiting]}")
            if notice is not None and notice.due():
                notice.say()
            time.sleep(_COMPUTATIONS_POLL_SECONDS)

    @staticmethod
    def _none_ran_since(lowered_at: float | None, begun: dict[QueueKey, int],
                        shown: dict[QueueKey, dict]) -> bool:
        """Whether a tapped computation was lowered lately and no device has begun or run one
        since: each is idle, and began none since ``begun`` and ended its last before then."""
        if lowered_at is None:
            return False
        since = time.monotonic() - lowered_at
        if since > _RECENT_LOWERING_SECONDS:
            return False
        return all(now["running"] == 0 and now["begun"] == begun[key]
                   and (now["seconds_since_end"] < 0 or now["seconds_since_end"] >= since)
                   for key, now in shown.items())

    def _stalled(self, key: QueueKey, now: dict, last_seen: dict) -> bool:
        """Whether the device has shown nothing new (computations begun or ended, records
        enqueued or delivered) for presumed_failed_s."""
        stats = outfeed.stats(key[1], platform=key[0])
        shown = (now["begun"], now["oldest_running"], now["running"],
                 stats["records_enqueued"], stats["records_delivered"])
        seen, since = last_seen.get(key, (None, time.monotonic()))
        if shown != seen:
            last_seen[key] = (shown, time.monotonic())
            return False
        return time.monotonic() - since >= self.presumed_failed_s

    def waits_for_receiver(self, device: Any) -> bool:
        """Whether a computation on ``device`` waits for its receiver now: a tap for room in the
        full queue, a computation's end for its taps (a busy consumer). The computations
        dispatched after it stay in flight meanwhile, as many as XLA's client takes. (A call
        waiting for its answer is not counted: a loop of calls on another thread waits so almost
        all the time, and a barrier must not wait for its end.)"""
        key = queue_key(device)
        if key not in self._devices:
            return False
        stats = outfeed.stats(key[1], platform=key[0])
        return stats["producers_waiting"] + stats["fences_waiting"] > 0

    def platform_groups(self) -> dict[str, list]:
        groups: dict[str, list] = {}
        for (platform, _), device in self._devices.items():
            groups.setdefault(platform, []).append(device)
        return groups

    # ---- statistics ----

    def _known_devices(self) -> dict[QueueKey, Any]:
        devices = self._devices  # (replaced whole as the receivers start, never grown)
        return devices or {queue_key(d): d for d in devices_to_receive(
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


def _release_if_held(lock: threading.RLock) -> None:
    """Releases ``lock`` if this thread holds it. On the main thread a KeyboardInterrupt can end
    the acquire that Condition.wait (or a notice's pause) makes on its way back, leaving it
    released; the KeyboardInterrupt, not a RuntimeError about the lock, is what the caller must
    see. (An RLock refuses a release by a thread that does not own it: no other thread's hold
    is undone.)"""
    try:
        lock.release()
    except RuntimeError:
        pass


receivers = ReceiverPool(registry)
os.register_at_fork(after_in_child=receivers.forked_in_child)


def reset_peak_bytes_queued() -> None:
    """Starts every local device's ``peak_bytes_queued`` (see queue_stats()) again from what is
    queued now, so that a check of the peak covers only what runs after it."""
    receivers.reset_peak_bytes_queued()
