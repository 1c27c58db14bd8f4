"""The ``outside_call`` primitive: a tap that hands its operands to the host and returns them.

Its rules sit below its definition, top to bottom: effects, abstract eval, dead-code
elimination, batching, jvp, lowering.

By default a tap declares no JAX effect: any effect sends the whole computation through JAX's
slow Python dispatch (70 to 180 us a call on a 2-core CPU) even when the tap never fires. Such a
tap is kept alive by its own DCE rule (and keep_taps.py for the control flow around it) and is
ordered after the previous tap of the same block by a token chain in the lowering. An
``ordered=True`` tap declares a shardable ordered effect instead, and JAX threads its token
through loops, branches and calls: strict program order, at JAX's dispatch cost.
"""

from __future__ import annotations

import dataclasses
import weakref

import jax
import numpy as np
from jax._src import config as jax_config
from jax._src import core, dispatch, effects, sharding_impls
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax.extend.core import Primitive

from hostcallback import keep_taps
from hostcallback.registry import registry

outside_call_p = Primitive("outside_call")
outside_call_p.multiple_results = True
# The lowering needs the device assignment to map partitions to devices.
dispatch.prim_requires_devices_during_lowering.add(outside_call_p)
keep_taps.register_tap_primitive(outside_call_p)

# emit_device: which local device ordinal enqueues (ALL_DEVICES: each that runs the tap).
ALL_DEVICES = -1
NO_LOCAL_DEVICE = -2


def bind(leaves, *, consumer_id: int, transport: str, ordered: bool = False,
         device_index: int = 0, result_avals: tuple | None = None, timeout_s: float = 0.0):
    """A tap (result_avals None: returns the leaves) or a call (returns arrays of result_avals)."""
    return outside_call_p.bind(*leaves, consumer_id=consumer_id, transport=transport,
                               ordered=ordered, device_index=device_index,
                               emit_device=ALL_DEVICES, result_avals=result_avals,
                               timeout_s=timeout_s)


# ---- effects ---------------------------------------------------------------------------------


class OrderedTapEffect(effects.Effect):
    """Taps that keep strict program order with each other, on each device."""

    __str__ = __repr__ = lambda self: "HostcallbackOrderedTap"


ordered_tap_effect = OrderedTapEffect()
for _effect_set in (effects.lowerable_effects, effects.control_flow_allowed_effects,
                    effects.ordered_effects, effects.shardable_ordered_effects,
                    effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
    _effect_set.add_type(OrderedTapEffect)


# ---- evaluation ------------------------------------------------------------------------------


def _impl(*args, **params):
    return dispatch.apply_primitive(outside_call_p, *args, **params)


outside_call_p.def_impl(_impl)


def _abstract_eval(*avals, ordered, result_avals, **params):
    outs = avals if result_avals is None else result_avals
    return outs, ({ordered_tap_effect} if ordered else core.no_effects)


outside_call_p.def_effectful_abstract_eval(_abstract_eval)


def _dce_rule(used_outputs, eqn):
    # A tap is a side effect: it stays even when nothing uses what it returns.
    return [True] * len(eqn.invars), eqn


pe.dce_rules[outside_call_p] = _dce_rule


# ---- transformations ------------------------------------------------------------------------


def _batching_rule(args, dims, *, consumer_id, **params):
    """One tap of the whole batch; the consumer learns which axis of each leaf is the batch."""
    if params["result_avals"] is not None:
        raise NotImplementedError(
            f"vmap of hostcallback.call ({registry.get(consumer_id).name}) is not supported yet: "
            "call the host once per element with lax.map, or batch inside the callback")
    batch_dims = tuple(dims)  # None marks a leaf that is not batched
    batched = registry.get(consumer_id).with_transform(("batch", {"batch_dims": batch_dims}))
    outs = outside_call_p.bind(*args, consumer_id=registry.register(batched), **params)
    return outs, dims


batching.primitive_batchers[outside_call_p] = _batching_rule


def _jvp_rule(primals, tangents, **params):
    """The tap fires once, on primal values; tangents pass through untouched."""
    if params["result_avals"] is not None:
        raise TypeError(
            f"hostcallback.call ({registry.get(params['consumer_id']).name}) cannot be "
            "differentiated: JAX cannot see inside host code. Wrap it in jax.custom_vjp and "
            "compute the backward pass yourself (it may be another call); see "
            "docs/transformations.md")
    return outside_call_p.bind(*primals, **params), tangents


ad.primitive_jvps[outside_call_p] = _jvp_rule


# ---- lowering ----------------------------------------------------------------------------------


def _local_ordinal(device) -> int:
    """The ordinal XLA gives the FFI handler for a device, or NO_LOCAL_DEVICE if it is remote."""
    if device.process_index != jax.process_index():
        return NO_LOCAL_DEVICE
    return device.id


def _manual_sharding(result_ranks: list[int]):
    """The annotation that says: run this op on every device, on its own data (shard_map).
    Shardy wants one entry per result, with one dimension entry per dimension."""
    from jax._src.lib import xla_client as xc

    if jax_config.use_shardy_partitioner.value:
        return sharding_impls.SdyArrayList(tuple(
            sharding_impls.SdyArray(
                mesh_shape=(), logical_device_ids=(),
                dim_shardings=(sharding_impls.SdyDim(axes=(), is_open=False),) * rank)
            for rank in result_ranks))
    op_sharding = xc.OpSharding()
    op_sharding.type = xc.OpSharding.Type.MANUAL
    return op_sharding


def _lower_in_manual_region(ctx, args, *, device_index, **params):
    """Runs the tap inside a shard_map over all devices, so that each device sees the whole value,
    and lets only the device at ``device_index`` enqueue it. XLA's Shardy partitioner keeps the
    maximal sharding JAX uses for this only on JAX's own callback targets, so we cannot use it."""
    devices = ctx.module_context.axis_context.device_assignment
    if not 0 <= device_index < len(devices):
        raise ValueError(
            f"device_index={device_index} is out of range for a computation on {len(devices)} devices")
    mesh_devices = np.empty(len(devices), dtype=object)
    mesh_devices[:] = list(devices)
    mesh = jax.sharding.Mesh(mesh_devices, ("_hostcallback_devices",))
    emit_device = _local_ordinal(devices[device_index])

    def tap_on_every_device(*xs):
        return outside_call_p.bind(*xs, device_index=device_index, emit_device=emit_device, **params)

    replicated = jax.sharding.PartitionSpec()
    region = jax.shard_map(tap_on_every_device, mesh=mesh, in_specs=replicated,
                           out_specs=replicated, check_vma=False)
    # The avals may carry the outer computation's sharding; inside the region they are whole.
    plain = [core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_in]
    region_ctx = dataclasses.replace(ctx, avals_in=plain, avals_out=plain)
    outs = mlir.lower_fun(region, multiple_results=True)(region_ctx, *args)
    if region_ctx.tokens_out is not None:
        ctx.set_tokens_out(region_ctx.tokens_out)
    return outs


# Per MLIR module being lowered: block -> token of the last tap emitted in that block.
_token_chains: weakref.WeakKeyDictionary[ir.Module, dict] = weakref.WeakKeyDictionary()


def _token_chain(ctx) -> dict:
    return _token_chains.setdefault(ctx.module_context.module, {})


def _lowering(ctx, *args, consumer_id, transport, ordered, device_index, emit_device,
              result_avals, timeout_s, platform):
    from hostcallback.transport import emitter_for

    is_call = result_avals is not None
    axis_context = ctx.module_context.axis_context
    op_sharding = None
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        if axis_context.manual_axes != frozenset(axis_context.mesh.axis_names):
            raise NotImplementedError(
                "hostcallback taps inside shard_map need every mesh axis to be manual; with "
                "partially automatic axes, tap outside the shard_map or make all axes manual")
        op_sharding = _manual_sharding([0] + [a.ndim for a in result_avals or ()])  # token first
    elif (isinstance(axis_context, sharding_impls.ShardingContext)
          and axis_context.num_devices > 1):
        if is_call:
            raise NotImplementedError(
                "hostcallback.call inside a jit that is sharded over several devices is not "
                "supported yet: put the call inside shard_map (each device calls with its "
                "shard) or in a jit on one device")
        return _lower_in_manual_region(ctx, args, consumer_id=consumer_id, transport=transport,
                                       ordered=ordered, device_index=device_index,
                                       result_avals=None, timeout_s=timeout_s)
    emit = emitter_for(transport, platform)
    if ordered:
        # JAX threads this token through loops, branches and calls: strict program order.
        token = ctx.tokens_in.get(ordered_tap_effect)
    else:
        # Our own chain: program order among the taps of one block (straight-line code).
        block = ir.InsertionPoint.current.block
        token = _token_chain(ctx).get(block) or mlir.hlo.create_token()
    if is_call:
        token, outs = emit.call(ctx, list(args), consumer_id=consumer_id, token=token,
                                op_sharding=op_sharding, result_avals=result_avals,
                                timeout_s=timeout_s)
    else:
        token = emit.tap(ctx, list(args), consumer_id=consumer_id, emit_device=emit_device,
                         token=token, op_sharding=op_sharding)
        outs = list(args)
    if ordered:
        ctx.set_tokens_out(mlir.TokenSet({ordered_tap_effect: token}))
    else:
        _token_chain(ctx)[block] = token
    return outs


for _platform in ("cpu", "cuda", "rocm", "tpu"):
    mlir.register_lowering(
        outside_call_p,
        lambda ctx, *args, _platform=_platform, **params: _lowering(
            ctx, *args, platform=_platform, **params),
        platform=_platform, cacheable=False)

__all__ = ["ALL_DEVICES", "bind", "outside_call_p"]
