"""The host side: one receiver thread per local device drains its outfeed queue and calls consumers.

Threads start lazily, the first time a tap is traced. Each waits in C++ with the GIL released,
decodes records (wire.py), and calls the registered consumer; records of one device are handled
one at a time, in the order the device produced them. A consumer that raises is logged and
remembered; later records still flow, and the next barrier_wait raises CallbackException.

barrier_wait sends marker computations and waits until every device's receiver has handled
them. XLA's CPU client runs single-device computations one after another (client-wide) and
multi-device computations one after another, but the two kinds independently of each other. So
each barrier sends one single-device marker to every device and one marker computation over all
local devices: each kind of computation dispatched before the barrier finished, and its taps
were handled, before the marker of its kind.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np
from jax._src import core

from hostcallback import config, results, wire
from hostcallback._native import outfeed
from hostcallback.registry import BARRIER_MARKER_ID, ConsumerRegistry, registry

logger = logging.getLogger("hostcallback")

_DRAIN_RECORDS = 1024
_DRAIN_BYTES = 64 << 20
_POLL_SECONDS = 0.25


class CallbackException(Exception):
    """A tap consumer raised since the last barrier_wait; ``__cause__`` is the first exception."""


class ReceiverStoppedError(RuntimeError):
    """The receivers were stopped with stop_outfeed_receiver(); taps cannot be delivered any more."""


@dataclasses.dataclass(frozen=True)
class RecordContext:
    """The record a consumer is being called for: where it came from and its place in line."""

    device: Any
    sequence: int
    consumer_id: int


_current = threading.local()


def current_record() -> RecordContext | None:
    """Inside a tap consumer: the record it was called for; elsewhere None."""
    return getattr(_current, "record", None)


class _Failure:
    __slots__ = ("consumer_name", "device", "error")

    def __init__(self, consumer_name: str, device: Any, error: BaseException) -> None:
        self.consumer_name, self.device, self.error = consumer_name, device, error

    def describe(self) -> str:
        return f"{self.consumer_name} on {self.device}: {type(self.error).__name__}: {self.error}"


class ReceiverPool:
    """The receiver threads of this process and the bookkeeping barrier_wait needs."""

    def __init__(self, consumers: ConsumerRegistry) -> None:
        self._consumers = consumers
        self._lock = threading.Lock()
        self._marker_seen = threading.Condition(self._lock)
        self._threads: dict[int, threading.Thread] = {}
        self._devices: dict[int, Any] = {}
        self._markers: dict[int, set[int]] = {}
        self._delivered: dict[int, int] = {}
        self._first_failure: _Failure | None = None
        self._last_failure: _Failure | None = None
        self._failure_count = 0
        self._next_marker = itertools.count(1)
        self._stopping = threading.Event()
        self._stopped = False
        self._local = threading.local()
        self._flush_hooks: weakref.WeakSet = weakref.WeakSet()
        self._marker_computations: dict[str, tuple] = {}  # per transport, built on first use

    # ---- lifecycle ----

    def ensure_started(self) -> None:
        """Starts one receiver per local device, once; refuses after stop_outfeed_receiver()."""
        if self._threads and not self._stopped:
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
            for device in jax.local_devices():
                ordinal = device.id  # what XLA hands the FFI handler as the device ordinal
                self._devices[ordinal] = device
                self._markers[ordinal] = set()
                self._delivered[ordinal] = 0
                thread = threading.Thread(target=self._receive, args=(ordinal,), daemon=True,
                                          name=f"hostcallback-receiver-{ordinal}")
                self._threads[ordinal] = thread
                thread.start()
            atexit.register(self._at_exit)

    @property
    def started(self) -> bool:
        return bool(self._threads) and not self._stopped

    def stop(self, timeout: float | None = None) -> int:
        """Delivers what is queued, then stops the threads; returns how many records were left."""
        if not self.started:
            self._stopped = self._stopped or bool(self._threads)
            return 0
        try:
            self.barrier_wait(timeout=timeout, raise_errors=False)
        except TimeoutError as error:
            logger.warning("hostcallback: %s", error)
        outfeed.set_closed(True)
        self._stopping.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads.values():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._stopped = True
        return self.undelivered()

    def undelivered(self) -> int:
        """Records enqueued on this process's devices that no receiver has handled yet."""
        with self._lock:
            return sum(outfeed.stats(o)["records_enqueued"] - self._delivered[o]
                       for o in self._threads)

    def _at_exit(self) -> None:
        timeout = config.settings.exit_timeout_s
        deadline = time.monotonic() + timeout
        if not self.started:
            self._run_flush_hooks(deadline)
            return
        undelivered = self.stop(timeout=timeout)
        self._run_flush_hooks(deadline)
        if undelivered:
            logger.warning("hostcallback: %d tap records were not delivered before exit (waited "
                           "%.1f s; set HOSTCALLBACK_EXIT_TIMEOUT to wait longer)",
                           undelivered, timeout)
        if self._failure_count:
            logger.error("hostcallback: %d tap consumer(s) raised and no barrier_wait reported it",
                         self._failure_count)

    # ---- the receiver threads ----

    def _receive(self, ordinal: int) -> None:
        self._local.is_receiver = True
        device = self._devices[ordinal]
        while True:
            batch = outfeed.drain(ordinal, _DRAIN_RECORDS, _DRAIN_BYTES, _POLL_SECONDS)
            for raw in batch:
                self._deliver(ordinal, device, raw)
            # The queues are closed before _stopping is set, so an empty batch now means done.
            if not batch and self._stopping.is_set():
                return
            del batch

    def _deliver(self, ordinal: int, device: Any, raw: np.ndarray) -> None:
        consumer_name = "<undecodable record>"
        record = None
        try:
            record = wire.decode_record(raw)
            if record.consumer_id == BARRIER_MARKER_ID:
                with self._lock:
                    self._markers[ordinal].add(int(record.arrays[0]))
                    self._marker_seen.notify_all()
                return
            consumer = self._consumers.get(record.consumer_id)
            consumer_name = consumer.name or getattr(consumer.func, "__name__", repr(consumer.func))
            _current.record = RecordContext(device, record.sequence, record.consumer_id)
            try:
                result = consumer.call(list(record.arrays), device)
            finally:
                _current.record = None
            if record.expects_response:
                outfeed.respond(ordinal, record.sequence, results.result_leaves(consumer, result))
        except Exception as error:  # a consumer's error must never stop the receiver
            if record is not None and record.expects_response:
                # The device is waiting: fail its call with the reason, keep the process alive.
                outfeed.respond_error(ordinal, record.sequence,
                                      f"hostcallback call consumer {consumer_name} failed: "
                                      f"{type(error).__name__}: {error}")
            logger.error("hostcallback: tap consumer %s raised on %s", consumer_name, device,
                         exc_info=error)
            failure = _Failure(consumer_name, device, error)
            with self._lock:
                self._failure_count += 1
                self._first_failure = self._first_failure or failure
                self._last_failure = failure
        finally:
            with self._lock:
                self._delivered[ordinal] += 1

    # ---- barrier ----

    def barrier_wait(self, logging_name: str | None = None, timeout: float | None = None,
                     raise_errors: bool = True) -> None:
        if getattr(self._local, "is_receiver", False):
            raise RuntimeError(
                "barrier_wait() was called from inside a tap consumer; it would wait for itself. "
                "Call it from the code that runs the computation instead.")
        if not core.trace_state_clean():
            raise RuntimeError(
                "barrier_wait() was called while tracing (inside jit, vmap, grad, ...); it waits "
                "on the host for taps and cannot be part of a computation. Call it after the "
                "computation, outside any transformation.")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.started:
            self._wait_for_markers(logging_name, timeout)
        self._run_flush_hooks(deadline)
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

    def _wait_for_markers(self, logging_name: str | None, timeout: float | None) -> None:
        with self._lock:
            marker = 2 * next(self._next_marker)
        expected = {marker, marker + 1} if len(self._devices) > 1 else {marker}
        if logging_name:
            logger.debug("hostcallback: barrier %s (marker %d) starts", logging_name, marker)
        self._send_markers(marker)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                while True:
                    behind = [o for o in self._devices if not expected <= self._markers[o]]
                    if not behind:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        pending = {str(self._devices[o]): outfeed.stats(o)["records_enqueued"]
                                   - self._delivered[o] for o in behind}
                        raise TimeoutError(
                            f"barrier_wait{f' ({logging_name})' if logging_name else ''} timed "
                            f"out after {timeout} s; records still to be handled per device: "
                            f"{pending}. A consumer may be slow or stuck.")
                    self._marker_seen.wait(remaining if remaining is not None else _POLL_SECONDS)
            finally:
                for seen in self._markers.values():
                    seen.difference_update(expected)
        if logging_name:
            logger.debug("hostcallback: barrier %s (marker %d) done", logging_name, marker)

    def _send_markers(self, marker: int) -> None:
        """A single-device marker (value ``marker``) to each device, and one computation over all
        local devices that sends ``marker + 1`` from each of them."""
        from hostcallback import primitive, transport

        # The markers travel by the transport in use now, as the taps they wait for do.
        transport_name = transport.default_transport()
        if transport_name not in self._marker_computations:

            def tap_marker(x):
                return primitive.bind([x], consumer_id=BARRIER_MARKER_ID, transport=transport_name)

            all_devices_marker = None
            if len(self._devices) > 1:
                mesh = jax.sharding.Mesh(np.array(list(self._devices.values())), ("devices",))
                spec = jax.sharding.PartitionSpec("devices")
                all_devices_marker = (jax.jit(jax.shard_map(
                    lambda x: tap_marker(x.reshape(()))[0].reshape(1), mesh=mesh, in_specs=spec,
                    out_specs=spec)), jax.sharding.NamedSharding(mesh, spec))
            self._marker_computations[transport_name] = (jax.jit(tap_marker), all_devices_marker)
        single_device_marker, all_devices_marker = self._marker_computations[transport_name]
        for device in self._devices.values():
            single_device_marker(jax.device_put(np.uint64(marker), device))
        if all_devices_marker is not None:
            computation, sharding = all_devices_marker
            markers = np.full(len(self._devices), marker + 1, dtype=np.uint64)
            computation(jax.device_put(markers, sharding))

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

    def queue_stats(self) -> dict[Any, dict[str, Any]]:
        """Per local device: the native queue's counters plus records handled by the receiver."""
        devices = self._devices or {d.id: d for d in jax.local_devices()}
        out = {}
        for ordinal, device in devices.items():
            stats = dict(outfeed.stats(ordinal))
            stats["records_handled"] = self._delivered.get(ordinal, 0)
            out[device] = stats
        return out


receivers = ReceiverPool(registry)
