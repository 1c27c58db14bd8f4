"""Many records of one tap site at once, for tap functions that can take them together.

A tap function (an ``id_tap`` consumer, not a ``call``) whose class defines a
``tap_batch(batch)`` method is handed each run of consecutive records of its tap site from one
device as one RecordBatch, in order, instead of being called once per record. It must do what
calling it per record would do. Sinks that write many records in one go (consumer.FileSink,
SocketSink) use this: their frames are put together in C++ for the whole batch. Inside
``tap_batch`` ``current_record()`` names the batch's first record, then each record in turn as
``batch.values()`` yields it; an exception fails the batch's records together and is reported
once at the next ``barrier_wait``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hostcallback._host.record_context import for_this_thread
from hostcallback._records.record_layout import CONSUMER_ID, LEAVES, SEQUENCE
from hostcallback._records.registry import Consumer, Transform


class RecordBatch:
    """Records ``records[start:stop]`` as the receiver drained them, all of ``consumer`` and
    all from ``device``; each is (consumer_id, device id, sequence, flags, leaves)."""

    __slots__ = ("consumer", "device", "records", "start", "stop")

    def __init__(self, records: list, start: int, stop: int, consumer: Consumer,
                 device: Any) -> None:
        self.records, self.start, self.stop = records, start, stop
        self.consumer, self.device = consumer, device

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def consumer_id(self) -> int:
        return self.records[self.start][CONSUMER_ID]

    @property
    def transforms(self) -> tuple[Transform, ...]:
        """What the tap function gets as ``transforms`` for each of these records."""
        return self.consumer.transforms_for(self.device)

    def sequences(self) -> list[int]:
        """Each record's sequence number on its device, in order."""
        return [record[SEQUENCE] for record in self.records[self.start:self.stop]]

    def values(self) -> Iterator[Any]:
        """Each record's tapped value, as the tap function would get it as ``arg``; while a
        value is being handled, ``current_record()`` names its record (and afterwards what it
        named before). Iterate it on the receiver thread, inside ``tap_batch``."""
        current = for_this_thread()
        before = current.record
        try:
            for record in self.records[self.start:self.stop]:
                current.record = record
                yield self.consumer.arg_of(record[LEAVES])
        finally:
            current.record = before


def run_end(records: list, start: int) -> int:
    """Where the run of records of records[start]'s consumer that decoded (arrays, not the
    reason they could not be decoded) ends."""
    consumer_id, end, count = records[start][CONSUMER_ID], start + 1, len(records)
    while (end < count and records[end][CONSUMER_ID] == consumer_id
           and records[end][LEAVES].__class__ is tuple):
        end += 1
    return end
