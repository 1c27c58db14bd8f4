"""Where a decoded record keeps its fields: positions in the tuples ``drain()`` returns.

The C++ core decodes each record into a tuple (consumer id, device id, sequence number, flags,
leaves): a tuple, not an object, because the receiver reads millions of them a second. The
receiver, ``RecordBatch.records`` and add-ons (through ``hostcallback.addons``) name the fields
by these positions. ``LEAVES`` holds the reason instead when the record could not be decoded.
"""

from __future__ import annotations

from hostcallback._native import outfeed

CONSUMER_ID = outfeed.RECORD_CONSUMER_ID  # the tap site's consumer id
DEVICE_ID = outfeed.RECORD_DEVICE_ID  # the id of the device that sent the record
SEQUENCE = outfeed.RECORD_SEQUENCE  # the record's sequence number on its device
FLAGS = outfeed.RECORD_FLAGS  # the record's flags (wire.FLAG_EXPECTS_RESPONSE)
LEAVES = outfeed.RECORD_LEAVES  # the tapped value's leaves as numpy arrays, or why not
