"""Consumer failures: kept for the next barrier_wait, and logged without flooding.

A receiver hands every exception a consumer raises to ``Failures.record``; the barrier raises
``CallbackException`` from the first, naming the last (in legacy host_callback's words), how
many there were, and the first. Nothing
here may fail on a user's exception (``describe_error``), and a kept failure holds no arrays.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any

from hostcallback.errors import CallbackException, describe_error

SUMMARY_SECONDS = 1.0  # repeated failures of one consumer are summarised at most this often


def without_locals(error: BaseException) -> BaseException:
    """The error as it is kept for the barrier and the failure log: its traceback without the
    receiver's frame and with the consumer's locals cleared, so that a kept failure does not
    keep the arrays it was called with (and their records) alive."""
    traceback_ = error.__traceback__
    if traceback_ is not None:
        error.__traceback__ = traceback_.tb_next
        traceback.clear_frames(error.__traceback__)
    return error


class Failure:
    __slots__ = ("consumer_name", "device", "error")

    def __init__(self, consumer_name: str, device: Any, error: BaseException) -> None:
        self.consumer_name, self.device, self.error = consumer_name, device, error

    def describe(self) -> str:
        return f"{self.consumer_name} on {self.device}: {describe_error(self.error)}"


class FailureLog:
    """Logs consumer failures without flooding: the first failure of each consumer in full
    (with its traceback), later ones as a count, summarised at most once a second."""

    def __init__(self, log: logging.Logger, interval_s: float = SUMMARY_SECONDS) -> None:
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
            try:
                self._log.error("hostcallback: %s %s raised %d more time(s); latest: %s",
                                what, name, count, describe_error(error))
            except Exception:  # noqa: BLE001, S110 - a handler that raises loses its line
                pass


class Failures:
    """The failures since the last barrier (their count, the first and the last), and the log."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = FailureLog(log)
        self._lock = threading.Lock()
        self._first: Failure | None = None
        self._last: Failure | None = None
        self.count = 0

    def record(self, what: str, name: str, device: Any, error: BaseException,
               report_at_barrier: bool = True, consumer_id: int | None = None) -> None:
        """Keeps the failure for the next barrier, then logs it; a logging handler that raises
        loses the log line, never the failure or the receiver."""
        if report_at_barrier:
            failure = Failure(name, device, error)
            with self._lock:
                self.count += 1
                self._first = self._first or failure
                self._last = failure
        try:
            self.log.failed(what, name, device, error, consumer_id)
        except Exception:  # noqa: BLE001 - a user's logging handler; nothing else to tell
            pass

    def raise_pending(self) -> None:
        """Raises CallbackException for the failures since the last call, and forgets them."""
        with self._lock:
            first, last, count = self._first, self._last, self.count
            self._first, self._last, self.count = None, None, 0
        if first is None:
            return
        # Legacy host_callback's words first (its tests match them), then the count and the first.
        message = ("There were exceptions during callback processing. Last one was: "
                   f"{last.describe()}. {count} tap consumer call(s) raised since the last "
                   "barrier_wait")
        if count > 1:
            message += f"; the first: {first.describe()}"
        raise CallbackException(message) from first.error
