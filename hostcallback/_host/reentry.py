"""Refuses taps and calls traced inside a tap consumer or call function, before they can deadlock.

A consumer runs on its device's receiver thread, and that thread is the only one that empties the
device's queue and answers its calls. A computation started from there that calls the host waits
for an answer only this thread could give; one that taps waits for it whenever the queue is full.
Both hang for good, so we fail at trace time instead, with what to do. This module must never
block or touch devices: it only reads the receiver's thread-local record.
"""

from __future__ import annotations

from hostcallback._host.record_context import current_record


def refuse_inside_consumer(what: str) -> None:
    """Raises RuntimeError when called on a receiver thread while it runs a consumer."""
    record = current_record()
    if record is None:
        return
    raise RuntimeError(
        f"{what} was traced inside a tap consumer or call function (running for a record from "
        f"{record.device}). That function runs on {record.device}'s receiver thread, the only "
        "thread that empties its queue and answers its calls, so a computation started from it "
        "that calls the host, or taps into a full queue, waits for itself forever. Do the work "
        "with numpy inside the consumer, or hand the values to your own thread (a "
        "queue.Queue) and run the JAX computation there; see 'JAX inside consumers' in the "
        "Architecture document.")
