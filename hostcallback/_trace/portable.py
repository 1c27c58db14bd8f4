"""Taps and calls on JAX's public API alone: the portable mode (``HOSTCALLBACK_PORTABLE=1``, or a
JAX whose internals the seam in ``hostcallback._jax`` cannot use).

A native tap is ``jax.ffi.ffi_call`` of the same C++ handler with ``has_side_effect=True``: JAX
keeps it when its result is unused, runs it inside loops and branches, and vmap calls it once per
batch element. It taps ``stop_gradient`` of its operands, so under grad it taps the primal values
once and the tangents pass around it. On a platform without the native handler (or with the
callback transport) the record is enqueued from ``jax.debug.callback`` (taps) or ``io_callback``
/ ``pure_callback`` (calls) into the queue of the process's first device. A barrier's markers
are enqueued from the host (lifecycle.py). Ready means handled here too: with no hook at a
computation's end, each tap waits on the device's thread until its record has been handled
(``delivery="async"`` leaves that out).

What it lacks is listed in ``hostcallback._jax.PORTABLE_LACKS``; asking for it is refused here
with an error that says so, never ignored. This module uses no private JAX module.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import io_callback

from hostcallback import _jax as jx
from hostcallback import config
from hostcallback._native import outfeed
from hostcallback._records import handover
from hostcallback._trace import transport
from hostcallback._trace.transport.native import (  # registers the handlers
    CALL_TARGET,
    TAP_HANDLED_TARGET,
    TAP_TARGET,
)
from hostcallback.flavors import PURE_FLAVOR


def _refuse(what: str) -> None:
    raise NotImplementedError(
        f"{what} needs JAX internals that hostcallback's portable mode does not use "
        f"({jx.PORTABLE_REASON}). The portable mode lacks {jx.PORTABLE_LACKS}.")


def _native_here(transport_name: str) -> bool:
    return transport_name == "native" and jax.default_backend() in transport.NATIVE_PLATFORMS


def host_device():
    """The device whose queue the callback transport's records go to in this mode."""
    return jax.local_devices()[0]


def _enqueue_on_host(consumer_id: int, await_handled: bool):
    def enqueue(*arrays):
        device = host_device()
        handover.enqueue_tap(device.id, consumer_id, [np.asarray(a) for a in arrays],
                             device.platform)
        if await_handled:
            failure = outfeed.await_taps(device.id, platform=device.platform)
            if failure:
                raise RuntimeError(failure)
    return enqueue


def bind(leaves, *, consumer_id: int, transport: str, ordered: bool = False,
         device_index: int = 0, result_avals: tuple | None = None, timeout_s: float = 0.0,
         flavor: str = "io_callback", vmap_method: str | None = None,
         partitioned: bool = False, replays: str = "deliver"):
    """A tap (result_avals None: returns the leaves) or a call (returns arrays of result_avals)."""
    del device_index  # one device runs a computation that is not split over several
    if ordered:
        _refuse("ordered=True (HOSTCALLBACK_ORDERED=1)")
    if config.settings.delivery == "dispatch":
        _refuse('delivery="dispatch" (HOSTCALLBACK_DELIVERY=dispatch)')
    if partitioned:
        _refuse("partitioned=True")
    if replays != "deliver":
        _refuse(f"replays={replays!r}")
    if result_avals is not None:
        return _call(leaves, consumer_id, transport, result_avals, timeout_s, flavor,
                     vmap_method)
    # A PURE tap would have to return its operands through the handler to be dropped.
    if flavor == PURE_FLAVOR:
        _refuse("callback_flavor=PURE for a tap")
    stopped = [jax.lax.stop_gradient(leaf) for leaf in leaves]
    # Without a hook at a computation's end, each tap waits there until it has been handled.
    await_handled = config.settings.delivery == "handled"
    if _native_here(transport):
        target = TAP_HANDLED_TARGET if await_handled else TAP_TARGET
        jax.ffi.ffi_call(target, (), has_side_effect=True, vmap_method="sequential")(
            *stopped, consumer_id=np.uint64(consumer_id),
            emit_device=np.int64(outfeed.ALL_DEVICES))
    else:
        jax.debug.callback(_enqueue_on_host(consumer_id, await_handled), *stopped)
    return list(leaves)


def _call(leaves, consumer_id, transport_name, result_avals, timeout_s, flavor, vmap_method):
    if vmap_method not in (None, "sequential", "sequential_unrolled"):
        # The host would see the batch, and answer for it, without the consumer knowing.
        _refuse(f"vmap_method={vmap_method!r} (only 'sequential' and 'sequential_unrolled')")
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in result_avals]
    if _native_here(transport_name):
        outs = jax.ffi.ffi_call(CALL_TARGET, shapes, has_side_effect=flavor != PURE_FLAVOR,
                                vmap_method=vmap_method)(
            *leaves, consumer_id=np.uint64(consumer_id),
            emit_device=np.int64(outfeed.ALL_DEVICES), timeout_s=np.float64(timeout_s))
        return list(outs)

    def call_on_host(*arrays):
        device = host_device()
        answers = handover.call_and_wait(device.id, consumer_id, [np.asarray(a) for a in arrays],
                                timeout_s, platform=device.platform)
        return tuple(np.frombuffer(answer, dtype=s.dtype).reshape(s.shape)
                     for answer, s in zip(answers, shapes))

    if flavor == PURE_FLAVOR:
        outs = jax.pure_callback(call_on_host, tuple(shapes), *leaves,
                                 vmap_method=vmap_method)
    else:
        outs = io_callback(call_on_host, tuple(shapes), *leaves)
    return list(outs)


__all__ = ["bind", "host_device"]
