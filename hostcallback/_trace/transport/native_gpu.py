"""The native transport on CUDA GPUs: a tap lowers to the same custom call as on CPU, which XLA
runs with the GPU tap handler (_native/cuda_tap.cc): it queues the copies of the tapped arrays
and their delivery on the device's stream, and the stream never waits for the host. A ``call``
takes JAX's host callback (callback.py): the stream needs the host's answer before it goes on,
and JAX's handler synchronises the stream for that as any would.
"""

from __future__ import annotations

from hostcallback._trace.transport import callback, native

lower_tap = native.lower_tap
shard_callback = native.shard_callback  # each device's shard lowers as any tap does
lower_call = callback.lower_call
lower_check = callback.lower_check
lower_tap_shard = callback.lower_tap_shard
