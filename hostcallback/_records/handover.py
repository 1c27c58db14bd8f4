"""Taps and calls made from Python (the callback transport): large arrays and answers handed
over without a copy.

A call's record, and a large tap's, carries only a ticket (FLAG_HANDED_OVER_IN_PYTHON), and the
arrays wait here under it:

- A call waits for its answer: the receiver takes the arguments from here by the ticket, calls
  the function, leaves the result arrays here under the same ticket, and wakes the caller through
  the core with an empty answer; the caller takes the arrays from here. The caller removes both
  entries when its wait ends, however it ends, and an answer whose caller no longer waits (timed
  out, stopped) is removed by the receiver at once: nothing is left behind.
- A tap returns at once, so only arrays that nothing else can change or free are handed over:
  each must own its memory whole, as the arrays JAX's CPU client hands a host callback do
  (tests/records/test_call_handover.py checks it). Its record weighs the arrays' bytes against the
  queue's budget as if it held them (a full queue makes the device wait, as for any tap), and
  the receiver takes them from here as it drains the record (with_tap_arrays); where the record
  will never be drained (its batch was lost, its receiver died or ended), the receiver lets go of
  them (forget_batch, forget_queue). Taps under
  TAP_HANDOVER_MIN_BYTES, and arrays over memory held by something else (on GPU, a capsule of
  jaxlib's; in the portable mode, a jax.Array), are copied into the record as the native handler
  copies.

The caller reads the result arrays right after the function returned, on the device's thread:
a function that changes an array after returning it may change what the device gets.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from hostcallback._native import outfeed
from hostcallback._records import wire
from hostcallback._records.record_layout import FLAGS, LEAVES

# From here on a tap's copy into its record costs the device more than handing its arrays over
# (2026-11-26, 2-core CPU: 7.3 against 6.6 us at 64 KiB, 4.1 against 6.4 us at 16 KiB).
TAP_HANDOVER_MIN_BYTES = 1 << 16

_tickets = itertools.count(1)  # next() is atomic under the GIL
_arguments: dict[int, tuple[np.ndarray, ...]] = {}
_answers: dict[int, list[np.ndarray]] = {}
# A handed-over tap's arrays by ticket, with the queue its record is in ((platform, device)).
_taps: dict[int, tuple[tuple[str, int], tuple[np.ndarray, ...]]] = {}
# Masks a record's flags to tell a tap handed over (FLAG_HANDED_OVER_IN_PYTHON alone) from a call.
_HANDED_OVER_TAP = wire.FLAG_HANDED_OVER_IN_PYTHON | wire.FLAG_EXPECTS_RESPONSE


def enqueue_tap(device: int, consumer_id: int, arrays: Sequence[np.ndarray], platform: str) -> None:
    """Queues a tap of ``arrays`` as outfeed.enqueue does: handed over when large and each
    owning its memory whole, else copied into the record."""
    held_bytes = sum(a.nbytes for a in arrays)
    if held_bytes < TAP_HANDOVER_MIN_BYTES or not all(_owns_its_memory(a) for a in arrays):
        outfeed.enqueue(device, consumer_id, [wire.as_leaf(a) for a in arrays], platform=platform)
        return
    ticket = next(_tickets)
    _taps[ticket] = ((platform, device), tuple(_read_only(a) for a in arrays))
    try:
        outfeed.enqueue_handed_over(device, consumer_id, [wire.as_leaf(np.uint64(ticket))],
                                    held_bytes, platform=platform)
    except Exception:  # the core raises only for a record it did not queue
        _taps.pop(ticket, None)
        raise
    # A KeyboardInterrupt is not caught: raised as the call returns, it may follow a record
    # that went in, whose arrays must stay. So every queued record's arrays are here, and an
    # empty dict means that no batch holds a handed-over tap (with_tap_arrays).


def with_tap_arrays(batch: list) -> list:
    """A drained batch whose handed-over taps carry their arrays (taken from here) in place of
    their tickets; the batch itself when none is waiting."""
    if not _taps:
        return batch
    for index, record in enumerate(batch):
        if (record[FLAGS] & _HANDED_OVER_TAP == wire.FLAG_HANDED_OVER_IN_PYTHON
                and record[LEAVES].__class__ is not str):  # (a reason: the receiver reports it)
            _, arrays = _taps.pop(ticket_of(record[LEAVES]),
                                  (None, "its arrays, handed over in Python, were not there"))
            batch[index] = (*record[:LEAVES], arrays, *record[LEAVES + 1:])
    return batch


def forget_batch(batch: list) -> None:
    """Lets go of the arrays of a batch's handed-over taps: the batch was lost (its hand-over
    failed), so nothing will take them."""
    for record in batch:
        leaves = record[LEAVES]
        # Still its ticket (one 0-d uint64), not the arrays with_tap_arrays put in its place:
        # those are 64 KiB at least.
        if (record[FLAGS] & _HANDED_OVER_TAP == wire.FLAG_HANDED_OVER_IN_PYTHON
                and leaves.__class__ is tuple and len(leaves) == 1
                and leaves[0].shape == () and leaves[0].dtype == np.uint64):
            _taps.pop(ticket_of(leaves), None)


def forget_queue(platform: str, device: int) -> None:
    """Lets go of the arrays of every handed-over tap still queued on a queue that no receiver
    will drain any more (it died, or was stopped and ended)."""
    for ticket, (key, _) in list(_taps.items()):
        if key == (platform, device):
            _taps.pop(ticket, None)


def call_and_wait(device: int, consumer_id: int, arrays: Sequence[np.ndarray], timeout_s: float,
         platform: str) -> list[np.ndarray]:
    """Calls the consumer with ``arrays`` and returns its answer, one uint8 array per result
    leaf, as outfeed.call_host does, without copying either."""
    arguments = tuple(_read_only(a) for a in arrays)
    ticket = next(_tickets)
    _arguments[ticket] = arguments
    try:
        try:
            outfeed.call_host_handed_over(device, consumer_id, [wire.as_leaf(np.uint64(ticket))],
                                     timeout_s, platform=platform)
            return _answers[ticket]
        finally:
            _arguments.pop(ticket, None)
            _answers.pop(ticket, None)
    except KeyboardInterrupt:  # Ctrl-C while the main thread waited: it is the call's error
        raise KeyboardInterrupt("hostcallback: the call was interrupted (KeyboardInterrupt) "
                                "while it waited for the host's answer") from None


def ticket_of(leaves: Sequence[np.ndarray]) -> int:
    """The ticket of a record with FLAG_HANDED_OVER_IN_PYTHON: its one leaf."""
    return int(leaves[0])


def arguments(ticket: int) -> tuple[np.ndarray, ...] | None:
    """The call's arguments, or None if its caller stopped waiting (timed out, stopped)."""
    return _arguments.get(ticket)


def respond(platform: str, device: int, sequence: int, ticket: int,
            results: list[np.ndarray]) -> None:
    """The receiver's answer to the call record ``sequence``, whose ticket is ``ticket``."""
    _answers[ticket] = results  # before the caller wakes
    delivered = False
    try:
        delivered = outfeed.respond(device, sequence, [], platform=platform)
    finally:
        if not delivered:  # its caller gave up waiting, or the core refused the answer
            _answers.pop(ticket, None)


def _owns_its_memory(array: np.ndarray) -> bool:
    """Whether the array views all of the memory of an array that owns it (not a part of a
    larger array, whose rest it would keep alive unweighed, nor memory something else holds)."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root.base is None and root.flags.owndata and root.nbytes == array.nbytes


def _read_only(array) -> np.ndarray:
    """A read-only C-order view (a copy only where the array is not C-contiguous) of a dtype a
    record can hold, as a decoded record's arrays are."""
    view = np.asarray(array, order="C").view()
    wire.dtype_code(view.dtype)  # raises for a dtype the wire format lacks, as enqueue does
    view.flags.writeable = False
    return view
