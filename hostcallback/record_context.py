"""Which record the receiver thread is handing to a consumer right now (``current_record()``).

Kept apart from the receiver so that a batch (hostcallback.batches) can say which of its records
is being read. This module only reads and writes one thread-local; it never calls consumers.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple


class RecordContext(NamedTuple):
    """The record a consumer is being called for: where it came from and its place in line.
    Immutable; a named tuple because consumers may ask for it once per record."""

    device: Any
    sequence: int
    consumer_id: int


current = threading.local()  # per receiver: .device, and .record while a consumer runs


def current_record() -> RecordContext | None:
    """Inside a tap consumer: the record it was called for (inside ``tap_batch``: the batch's
    first, then each record as ``batch.values()`` yields it); elsewhere None. Built only when
    asked, from the decoded record the receiver holds."""
    record = getattr(current, "record", None)
    if record is None:
        return None
    return RecordContext(getattr(current, "device", None), record[2], record[0])
