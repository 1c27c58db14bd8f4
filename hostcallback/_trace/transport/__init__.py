"""The two ways a tap's bytes reach the outfeed queues; both feed the same receivers.

A transport module writes the MLIR for one tap, ``lower_tap(ctx, args, *, consumer_id,
emit_device, device_index, token, op_sharding) -> token``, and for one call, ``lower_call(ctx,
args, *, consumer_id, emit_device, device_index, token, op_sharding, result_avals, timeout_s)
-> (token, results)``.
emit_device is the one device that enqueues (its id, or NO_LOCAL_DEVICE if another process has
it) or ALL_DEVICES; where it is one device, device_index is that device's place among the
computation's devices, the same in every process. A shared call's devices then agree through
``lower_check(ctx, failed, values, *, consumer_id, op_sharding)``. For a partitioned tap under
automatic sharding, ``shard_callback(ctx)`` registers what each device's shard needs with the
whole computation and returns its index for ``lower_tap_shard(ctx, args, *, consumer_id,
callback_index, token, op_sharding)``, or returns None where a shard lowers as any tap does.
The lowering picks its transport once (emitter_for) and talks only to it. The native one calls
our C++ FFI handlers on the device thread (native_gpu: on a CUDA GPU's stream, for taps); the
callback one goes through JAX's host callbacks, for platforms that have no native handler.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from hostcallback import config
from hostcallback._jax import mlir
from hostcallback._native import ffi_api, outfeed
from hostcallback._trace.transport import callback, native, native_gpu

# None where this jaxlib refuses the core's handlers (ffi_api.py): the callback transport serves.
NATIVE_PLATFORMS = frozenset() if ffi_api.MISMATCH else frozenset({outfeed.NATIVE_PLATFORM})
# Where taps have a native handler of their own on another platform's device.
NATIVE_GPU_PLATFORMS = frozenset() if ffi_api.MISMATCH else frozenset({"cuda"})
# Where our primitives have lowerings: the native handler's platforms, and the callback
# transport's (every platform with JAX host callbacks).
LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def default_transport() -> str:
    return config.settings.transport or "native"


def emitter_for(transport: str, platform: str) -> ModuleType:
    """The transport module to use; native on a platform without a native handler falls back."""
    if transport == "native" and platform in NATIVE_PLATFORMS:
        return native
    if transport == "native" and platform in NATIVE_GPU_PLATFORMS:
        return native_gpu
    return callback


def register_lowering(primitive, rule: Callable[..., Any], **options: Any) -> None:
    """Registers ``rule(ctx, *args, platform=..., **params)`` for each of LOWERING_PLATFORMS."""
    for platform in LOWERING_PLATFORMS:
        mlir.register_lowering(
            primitive,
            lambda ctx, *args, _platform=platform, **params: rule(
                ctx, *args, platform=_platform, **params),
            platform=platform, **options)
