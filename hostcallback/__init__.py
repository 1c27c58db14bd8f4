"""hostcallback: see values from inside jitted JAX code on the host, without Python on the device thread.

The public API, and nothing else. The "Architecture" document says how a tap travels.
"""

from hostcallback import config
from hostcallback.api import (
                              barrier_wait,
                              call,
                              id_print,
                              id_tap,
                              pure_callback,
                              queue_stats,
                              stop_outfeed_receiver,
)
from hostcallback.config import configure
from hostcallback.flavors import CallbackFlavor
from hostcallback.receiver import (
                              CallbackException,
                              ReceiverStoppedError,
                              reset_peak_bytes_queued,
)
from hostcallback.record_context import RecordContext, current_record

__version__ = "0.1.0"

__all__ = [
    "CallbackException",
    "CallbackFlavor",
    "ReceiverStoppedError",
    "RecordContext",
    "barrier_wait",
    "call",
    "config",
    "configure",
    "current_record",
    "id_print",
    "id_tap",
    "pure_callback",
    "queue_stats",
    "reset_peak_bytes_queued",
    "stop_outfeed_receiver",
]
