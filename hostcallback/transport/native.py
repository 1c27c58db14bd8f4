"""The native transport: lowers a tap to our C++ FFI handler, which enqueues without Python.

The custom call takes the ordering token and the tapped arrays and returns a token; it has a side
effect, so XLA keeps it and never merges two of them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax._src import core
from jax._src.interpreters import mlir

from hostcallback._native import outfeed

TARGET = "hostcallback_tap"

for _name, _capsule in outfeed.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

_lower_tap = jax.ffi.ffi_lowering(TARGET, has_side_effect=True)


def emit(ctx, args, *, consumer_id: int, emit_device: int, token, op_sharding):
    call_ctx = dataclasses.replace(ctx, avals_in=[core.abstract_token, *ctx.avals_in],
                                   avals_out=[core.abstract_token])
    (token_out,) = _lower_tap(call_ctx, token, *args, consumer_id=np.uint64(consumer_id),
                              emit_device=np.int64(emit_device))
    if op_sharding is not None:
        mlir.set_sharding(ctx.module_context, token_out.owner, op_sharding)
    return token_out
