"""Where a decoded record keeps its fields: positions in the tuples ``drain()`` returns.

The C++ core decodes each record into a tuple (consumer id, device id, sequence number, flags,
leaves): a tuple, not an object, because the receiver reads millions of them a second. The
receiver, ``RecordBatch.records`` and add-ons (through ``hostcallback.addons``) name the fields
by these positions. ``LEAVES`` holds the reason instead when the record could not be decoded.
"""

from __future__ import annotations

CONSUMER_ID = 0  # the tap site's consumer id
DEVICE_ID = 1  # the id of the device that sent the record
SEQUENCE = 2  # the record's sequence number on its device
FLAGS = 3  # the receiver's flags for the record
LEAVES = 4  # the tapped value's leaves, as numpy arrays (the pytree's flattened form)
