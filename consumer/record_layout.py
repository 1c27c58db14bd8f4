"""Where a receiver's record keeps its fields: positions in the tuples of ``RecordBatch.records``.

A RecordBatch hands its records as the receiver drained them, each a tuple (consumer id, device
id, sequence number, flags, leaves); the consumers that read a record's fields themselves (the
frame templates, the tap adapter) name them by these positions, defined here once. When the core
defines them for add-ons (``hostcallback.addons``), this module gives way to it.
"""

from __future__ import annotations

CONSUMER_ID = 0  # the tap site's consumer id
DEVICE_ID = 1  # the id of the device that sent the record
SEQUENCE = 2  # the record's sequence number on its device
FLAGS = 3  # the receiver's flags for the record
LEAVES = 4  # the tapped value's leaves, as numpy arrays (the pytree's flattened form)
