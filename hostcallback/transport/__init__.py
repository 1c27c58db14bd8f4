"""The two ways a tap's bytes reach the outfeed queues; both feed the same receivers.

A transport module writes the MLIR for one tap, ``tap(ctx, args, *, consumer_id, emit_device,
token, op_sharding) -> token``, and for one call, ``call(ctx, args, *, consumer_id, emit_device,
token, op_sharding, result_avals, timeout_s) -> (token, results)``. The native one calls our C++ FFI
handlers on the device thread; the callback one goes through JAX's host callbacks, for platforms
that have no native handler.
"""

from __future__ import annotations

from types import ModuleType

from hostcallback import config

NATIVE_PLATFORMS = frozenset({"cpu"})


def default_transport() -> str:
    return config.settings.transport or "native"


def emitter_for(transport: str, platform: str) -> ModuleType:
    """The transport module to use; native on a platform without a native handler falls back."""
    if transport == "native" and platform in NATIVE_PLATFORMS:
        from hostcallback.transport import native

        return native
    from hostcallback.transport import callback

    return callback
