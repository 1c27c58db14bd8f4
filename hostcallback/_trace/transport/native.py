"""The native transport: lowers taps and calls to our C++ FFI handlers; no Python on the device.

A tap's custom call takes the ordering token and the tapped arrays and returns a token; a call's
also returns the host's results. Both have side effects, so XLA keeps them and never merges two.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

from hostcallback import _jax as jx
from hostcallback._native import ffi_api, outfeed

TAP_TARGET = "hostcallback_tap"
TAP_HANDLED_TARGET = "hostcallback_tap_handled"  # a tap that returns once it was handled
CALL_TARGET = "hostcallback_call"
SHARED_CALL_TARGET = "hostcallback_shared_call"  # a call met by every device in the handler
ORDER_TARGET = "hostcallback_order"  # a point in the program order (orders a shared call)
CHECK_TARGET = "hostcallback_check"

# The CUDA platform's handlers (the GPU tap) take effect once JAX's CUDA plugin starts; a process
# without one never runs them, and they load no CUDA library until a GPU tap runs.
_REGISTRATIONS = ((outfeed.registrations, outfeed.NATIVE_PLATFORM),
                  (outfeed.cuda_registrations, "CUDA"))

if ffi_api.MISMATCH is None:  # a registration jaxlib refuses would take its CPU backend down
    for _handlers, _platform in _REGISTRATIONS:
        for _name, _capsule in _handlers().items():
            try:
                jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)
            except Exception as error:  # noqa: BLE001 - jaxlib's own error type differs
                raise ImportError(
                    f"hostcallback's C++ core cannot be registered with this jaxlib "
                    f"({jax.__version__}) for {_platform}: {error}. The core was built against "
                    f"another JAX's FFI headers: {ffi_api.REBUILD}.") from error

_lower_tap = jax.ffi.ffi_lowering(TAP_TARGET, has_side_effect=True)
_lower_call = jax.ffi.ffi_lowering(CALL_TARGET, has_side_effect=True)
_lower_check = jax.ffi.ffi_lowering(CHECK_TARGET, has_side_effect=True)
_lower_shared_call = jax.ffi.ffi_lowering(SHARED_CALL_TARGET, has_side_effect=True)
_lower_order = jax.ffi.ffi_lowering(ORDER_TARGET, has_side_effect=True)


def lower_tap(ctx, args, *, consumer_id: int, emit_device: int, device_index: int, token,
        op_sharding):
    del device_index  # the handler compares its own device with emit_device
    call_ctx = dataclasses.replace(ctx, avals_in=[jx.abstract_token, *ctx.avals_in],
                                   avals_out=[jx.abstract_token])
    (token_out,) = _lower_tap(call_ctx, token, *args, consumer_id=np.uint64(consumer_id),
                              emit_device=np.int64(emit_device))
    if op_sharding is not None:
        jx.set_sharding(ctx.module_context, token_out.owner, op_sharding)
    return token_out


def shard_callback(ctx) -> None:
    """A partitioned tap needs nothing registered with the whole computation: each device's shard
    lowers to the handler as any tap does (tap)."""
    del ctx


def lower_call(ctx, args, *, consumer_id: int, emit_device: int, device_index: int, token,
         op_sharding, result_avals, timeout_s: float):
    """The device sends ``args`` and waits for the host's results, which the handler copies into
    the outputs: (token, *results). With emit_device >= 0 the other devices get zeros at once.

    The computation registers a host callback it never calls: jaxlib then runs it synchronously
    on CPU, as it runs computations with JAX's own callbacks. Dispatched asynchronously, steps
    sent back to back fill XLA's 32 computations in flight per device while the first waits for
    the host, and a call function that runs JAX work on that device waits for a slot forever."""
    jx.run_synchronously(ctx)
    call_ctx = dataclasses.replace(ctx, avals_in=[jx.abstract_token, *ctx.avals_in],
                                   avals_out=[jx.abstract_token, *result_avals])
    token_out, *results = _lower_call(call_ctx, token, *args, consumer_id=np.uint64(consumer_id),
                                      emit_device=np.int64(emit_device),
                                      timeout_s=np.float64(timeout_s))
    if op_sharding is not None:
        jx.set_sharding(ctx.module_context, token_out.owner, op_sharding)
    return token_out, results


def lower_shared_call(ctx, args, *, consumer_id: int, emit_device: int, parts: tuple,
                      sends: tuple, token, op_sharding, result_avals, timeout_s: float,
                      name: str):
    """One device's part of a call shared by the devices ``parts`` (ids): it brings its shards of
    ``args`` (those ``sends`` says it sends), emit_device's part calls the host with every
    part's, and each part returns the same answer (its last result, a uint32, is 1) or fails
    with the same error, which names the call function (``name``): (token, *results)."""
    call_ctx = dataclasses.replace(ctx, avals_in=[jx.abstract_token, *ctx.avals_in],
                                   avals_out=[jx.abstract_token, *result_avals])
    # The parts meet by the op's own id, which XLA gives every device's part of it: two calls of
    # one consumer in a step then never meet, in whatever order a device runs them.
    token_out, *results = _lower_shared_call(
        call_ctx, token, *args, consumer_id=np.uint64(consumer_id),
        emit_device=np.int64(emit_device), ordinals=np.array(parts, np.int64),
        sends=np.array(sends, np.int64), timeout_s=np.float64(timeout_s), name=name,
        site=np.uint64(next(_SHARED_CALL_SITES)))
    if op_sharding is not None:
        jx.set_sharding(ctx.module_context, token_out.owner, op_sharding)
    return token_out, results


def lower_order(ctx, values, *, token, op_sharding):
    """(token, a uint32 zero), both after ``token`` and ``values``."""
    order_ctx = dataclasses.replace(ctx, avals_in=[jx.abstract_token, *ctx.avals_in],
                                    avals_out=[jx.abstract_token, _ZERO])
    token_out, zero = _lower_order(order_ctx, token, *values)
    if op_sharding is not None:
        jx.set_sharding(ctx.module_context, token_out.owner, op_sharding)
    return token_out, zero


_ZERO = jx.ShapedArray((), np.uint32)
_SHARED_CALL_SITES = itertools.count(1)  # one per shared call op lowered in this process


def lower_check(ctx, failed, values, *, consumer_id: int, op_sharding):
    """After a shared call's results and failure flags were summed over the devices (see the
    handler): every device fails with the call's reason when any failed, else passes the flag and
    the values through."""
    results = _lower_check(ctx, failed, *values, consumer_id=np.uint64(consumer_id))
    if op_sharding is not None:
        jx.set_sharding(ctx.module_context, results[0].owner, op_sharding)
    return list(results)
