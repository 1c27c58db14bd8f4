"""The two ways a tap's bytes reach the outfeed queues; both feed the same receivers.

An emitter writes the MLIR for one tap: ``emit(ctx, args, *, consumer_id, emit_device, token,
op_sharding) -> token``. The native one calls our C++ FFI handler on the device thread; the
callback one goes through JAX's host callbacks, for platforms that have no native handler.
"""

from __future__ import annotations

from typing import Callable

from hostcallback import config

NATIVE_PLATFORMS = frozenset({"cpu"})


def default_transport() -> str:
    return config.settings.transport or "native"


def emitter_for(transport: str, platform: str) -> Callable:
    """The emitter to use; a native request on a platform without a native handler falls back."""
    if transport == "native" and platform in NATIVE_PLATFORMS:
        from hostcallback.transport import native

        return native.emit
    from hostcallback.transport import callback

    return callback.emit
