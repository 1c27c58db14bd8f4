"""The callback transport: the same tap contract on JAX's own host-callback machinery.

For platforms where our native handler is not registered (GPU and TPU today), or when
``HOSTCALLBACK_TRANSPORT=callback``. JAX hands the callback numpy arrays on the device's thread;
we copy them into the same outfeed queue the native handler writes, so the same receivers
deliver them. The callback never builds a jax.Array (that path hangs with several CPU devices
and large arguments, jax#25861) and never calls the consumer itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax._src import callback as jax_callback
from jax._src import core, sharding_impls
from jax._src.lib.mlir.dialects import hlo

from hostcallback import wire
from hostcallback._native import outfeed

_PARTITION_AVAL = core.ShapedArray((), np.uint32)


def _leaf(array: np.ndarray):
    array = np.asarray(array, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
    return wire.dtype_code(array.dtype), list(array.shape), array.reshape(-1).view(np.uint8)


def _ordinal_of_partition(axis_context) -> Callable[[np.ndarray], int]:
    """Maps XLA's partition id, as the callback receives it, to the calling device's ordinal."""
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        devices = tuple(axis_context.mesh.devices.flat)
    else:
        devices = tuple(getattr(axis_context, "device_assignment", None) or ())
    ordinals = tuple(d.id for d in devices)
    if not ordinals:
        return lambda partition: jax.local_devices()[0].id
    return lambda partition: ordinals[int(partition)]


def tap(ctx, args, *, consumer_id: int, emit_device: int, token, op_sharding):
    ordinal_of = _ordinal_of_partition(ctx.module_context.axis_context)

    def enqueue_on_host(partition, *arrays):
        ordinal = ordinal_of(partition)
        if emit_device in (-1, ordinal):
            outfeed.enqueue(ordinal, consumer_id, [_leaf(a) for a in arrays])
        return ()

    partition = hlo.partition_id()
    callback_ctx = dataclasses.replace(ctx, avals_in=[_PARTITION_AVAL, *ctx.avals_in], avals_out=[])
    _, token_out, _ = jax_callback.emit_python_callback(
        callback_ctx, enqueue_on_host, token, [partition, *args], callback_ctx.avals_in, [],
        has_side_effect=True, returns_token=True, sharding=op_sharding)
    return token_out


def call(ctx, args, *, consumer_id: int, emit_device: int, token, op_sharding, result_avals,
         timeout_s: float):
    """The device's Python callback sends the record and waits (GIL released) for the answer;
    with emit_device >= 0 the other devices return zeros at once."""
    ordinal_of = _ordinal_of_partition(ctx.module_context.axis_context)
    shapes = [(a.shape, np.dtype(a.dtype)) for a in result_avals]

    def call_on_host(partition, *arrays):
        ordinal = ordinal_of(partition)
        if emit_device not in (-1, ordinal):
            return tuple(np.zeros(shape, dtype) for shape, dtype in shapes)
        answers = outfeed.call(ordinal, consumer_id, [_leaf(a) for a in arrays], timeout_s)
        return tuple(np.frombuffer(answer, dtype=dtype).reshape(shape)
                     for answer, (shape, dtype) in zip(answers, shapes))

    if isinstance(op_sharding, sharding_impls.SdyArrayList) and result_avals:
        # With results, JAX adds the token's annotation itself.
        op_sharding = sharding_impls.SdyArrayList(op_sharding.shardings[1:])
    partition = hlo.partition_id()
    callback_ctx = dataclasses.replace(ctx, avals_in=[_PARTITION_AVAL, *ctx.avals_in],
                                       avals_out=list(result_avals))
    results, token_out, _ = jax_callback.emit_python_callback(
        callback_ctx, call_on_host, token, [partition, *args], callback_ctx.avals_in,
        list(result_avals), has_side_effect=True, returns_token=True, sharding=op_sharding)
    return token_out, list(results)
