"""What an add-on (a sink, a progress bar, an exporter) may use beyond the public tap API.

``hostcallback.consumer`` is written on this module and the public API alone, so a third party
can write a sink the way ours are written:

- ``add_flush_hook(owner)``: ``owner.flush()`` runs after every ``barrier_wait()`` and at exit,
  so a barrier also means "written"; an owner with ``flush_before(deadline)`` gets the caller's
  deadline (``time.monotonic()`` based, or None) instead and must not wait past it.
- ``RecordBatch``: a tap function whose class defines ``tap_batch(batch)`` gets each run of
  consecutive records of its tap site from one device at once (see ``hostcallback._host.batches``).
- ``current_record()`` and ``RecordContext``: inside a consumer, which record it is handling.
- ``CONSUMER_ID``, ``DEVICE_ID``, ``SEQUENCE``, ``FLAGS``, ``LEAVES``: where a record of
  ``RecordBatch.records`` keeps each field.
- ``format_value``, ``format_metadata`` and ``array_summary``: how ``id_print`` shows values.
- ``EqualByKey``: a base for tap functions that are objects; equal ones (by ``_key()``) make
  one consumer, so retracing a step reuses its tap site.
- ``add_installed_copies``: how an add-on with a compiled extension of its own finds it from a
  source checkout (its installed copy beside the sources on ``__path__``).
- ``exiting()``: whether exit's delivery has begun, so that a flush hook can tell its last
  flush, and say what it loses, from one after a barrier.
- ``exit_gate()``: the core's exit gate, for such an extension that releases the GIL: a receiver
  thread that comes back to it after exit's handler parks, as it does in the core (gil.h says why).
"""

from __future__ import annotations

from typing import Any

from hostcallback._host.batches import RecordBatch
from hostcallback._host.printing import array_summary, format_metadata, format_value
from hostcallback._host.record_context import RecordContext, current_record
from hostcallback._native import add_installed_copies, outfeed
from hostcallback._records.record_layout import CONSUMER_ID, DEVICE_ID, FLAGS, LEAVES, SEQUENCE
from hostcallback._records.registry import EqualByKey
from hostcallback.lifecycle import lifecycle

__all__ = ["CONSUMER_ID", "DEVICE_ID", "FLAGS", "LEAVES", "SEQUENCE", "EqualByKey", "RecordBatch",
           "RecordContext", "add_flush_hook", "add_installed_copies", "array_summary",
           "current_record", "exit_gate", "exiting", "format_metadata", "format_value"]


def add_flush_hook(owner: Any) -> None:
    """Flushes ``owner`` after every barrier and at exit, for as long as it lives (held weakly:
    a sink that is dropped is no longer flushed)."""
    lifecycle.add_flush_hook(owner)


def exiting() -> bool:
    """Whether interpreter exit's delivery has begun: a flush hook called now is the last one,
    and what it cannot write by its deadline is lost (say so)."""
    return lifecycle.exiting


def exit_gate() -> Any:
    """The core's exit gate (a capsule), for an extension's GilReleased (gil.h: ShareExitGate)."""
    return outfeed.exit_gate()
