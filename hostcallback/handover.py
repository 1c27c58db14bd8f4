"""Calls made from Python (the callback transport): arguments and answers handed over without a
copy.

The device's Python callback already holds its arguments as numpy arrays of its own (JAX hands a
host callback arrays that own their memory: tests/core/test_call_handover.py checks it), and
waits for the answer. So its call record carries only a ticket (FLAG_HANDED_OVER_IN_PYTHON):
the receiver takes the arguments from here by the ticket, calls the function, leaves the result
arrays here under the same ticket, and wakes the caller through the core with an empty answer;
the caller takes the arrays from here. The caller removes both entries when its wait ends,
however it ends, and an answer whose caller no longer waits (timed out, stopped) is removed by
the receiver at once: nothing is left behind.

The caller reads the result arrays right after the function returned, on the device's thread:
a function that changes an array after returning it may change what the device gets.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from hostcallback import wire
from hostcallback._native import outfeed

_tickets = itertools.count(1)  # next() is atomic under the GIL
_arguments: dict[int, tuple[np.ndarray, ...]] = {}
_answers: dict[int, list[np.ndarray]] = {}


def call(device: int, consumer_id: int, arrays: Sequence[np.ndarray], timeout_s: float,
         platform: str) -> list[np.ndarray]:
    """Calls the consumer with ``arrays`` and returns its answer, one uint8 array per result
    leaf, as outfeed.call does, without copying either."""
    arguments = tuple(_read_only(a) for a in arrays)
    ticket = next(_tickets)
    _arguments[ticket] = arguments
    try:
        outfeed.call_handed_over(device, consumer_id, [wire.as_leaf(np.uint64(ticket))],
                                 timeout_s, platform=platform)
        return _answers[ticket]
    finally:
        _arguments.pop(ticket, None)
        _answers.pop(ticket, None)


def ticket_of(leaves: Sequence[np.ndarray]) -> int:
    """The ticket of a call record with FLAG_HANDED_OVER_IN_PYTHON: its one leaf."""
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


def _read_only(array) -> np.ndarray:
    """A read-only C-order view (a copy only where the array is not C-contiguous) of a dtype a
    record can hold, as a decoded record's arrays are."""
    view = np.asarray(array, order="C").view()
    wire.dtype_code(view.dtype)  # raises for a dtype the wire format lacks, as enqueue does
    view.flags.writeable = False
    return view
