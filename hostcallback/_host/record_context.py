"""Which record the receiver thread is handing to a consumer right now (``current_record()``).

Kept apart from the receiver so that a batch (hostcallback._host.batches) can say which of its
records is being read. This module only keeps one plain object per thread; it never calls consumers.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from hostcallback._records.record_layout import CONSUMER_ID, SEQUENCE


class RecordContext(NamedTuple):
    """The record a consumer is being called for: where it came from and its place in line.
    Immutable; a named tuple because consumers may ask for it once per record."""

    device: Any
    sequence: int
    consumer_id: int


class ThreadContext:
    """One thread's: the device it receives for, and the record a consumer is being called for.
    A plain object, which the receiver sets once per record: setting an attribute of a
    ``threading.local`` costs about ten times as much (160 against 16 ns)."""

    __slots__ = ("device", "record")

    def __init__(self) -> None:
        self.device: Any = None
        self.record: tuple | None = None


_local = threading.local()


def for_this_thread() -> ThreadContext:
    """The calling thread's context, made on first use."""
    context = getattr(_local, "context", None)
    if context is None:
        context = _local.context = ThreadContext()
    return context


def current_record() -> RecordContext | None:
    """Inside a tap consumer: the record it was called for (inside ``tap_batch``: the batch's
    first, then each record as ``batch.values()`` yields it); elsewhere None. Built only when
    asked, from the decoded record the receiver holds."""
    context = getattr(_local, "context", None)
    if context is None or context.record is None:
        return None
    record = context.record
    return RecordContext(context.device, record[SEQUENCE], record[CONSUMER_ID])
