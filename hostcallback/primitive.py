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
from hostcallback.flavors import VMAP_METHODS
from hostcallback.registry import registry

outside_call_p = Primitive("outside_call")
outside_call_p.multiple_results = True
# The lowering needs the device assignment to map partitions to devices.
dispatch.prim_requires_devices_during_lowering.add(outside_call_p)
keep_taps.register_tap_primitive(outside_call_p)

# emit_device: which local device ordinal enqueues (ALL_DEVICES: each that runs the tap).
ALL_DEVICES = -1
NO_LOCAL_DEVICE = -2


PURE = "pure"  # CallbackFlavor.PURE.value: JAX may drop the callback when its result is unused


def bind(leaves, *, consumer_id: int, transport: str, ordered: bool = False,
         device_index: int = 0, result_avals: tuple | None = None, timeout_s: float = 0.0,
         flavor: str = "io_callback", vmap_method: str | None = None):
    """A tap (result_avals None: returns the leaves) or a call (returns arrays of result_avals)."""
    return outside_call_p.bind(*leaves, consumer_id=consumer_id, transport=transport,
                               ordered=ordered, device_index=device_index,
                               emit_device=ALL_DEVICES, result_avals=result_avals,
                               timeout_s=timeout_s, flavor=flavor, vmap_method=vmap_method)


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
    # A tap is a side effect: it stays even when nothing uses what it returns. A PURE one is not.
    if eqn.params["flavor"] == PURE and not any(used_outputs):
        return [False] * len(eqn.invars), None
    return [True] * len(eqn.invars), eqn


pe.dce_rules[outside_call_p] = _dce_rule


# ---- transformations ------------------------------------------------------------------------


def _batching_rule(args, dims, *, consumer_id, **params):
    """A tap: one tap of the whole batch; the consumer learns which axis of each leaf is the
    batch. A call: as its vmap_method says."""
    if params["result_avals"] is not None:
        return _batch_call(args, dims, consumer_id=consumer_id, **params)
    batch_dims = tuple(dims)  # None marks a leaf that is not batched
    batched = registry.get(consumer_id).with_transform(("batch", {"batch_dims": batch_dims}))
    outs = outside_call_p.bind(*args, consumer_id=registry.register(batched), **params)
    return outs, dims


def _batch_call(args, dims, *, consumer_id, result_avals, vmap_method, **params):
    """The vmap_method meanings of jax.pure_callback. The host sees leading batch axes (or one
    element at a time, for the sequential methods) and returns results to match."""
    consumer = registry.get(consumer_id)
    if vmap_method is None:
        raise NotImplementedError(
            f"vmap of hostcallback.call ({consumer.name}) needs a vmap_method: one of "
            f"{', '.join(map(repr, VMAP_METHODS))}. 'sequential' calls the host once per batch "
            "element; 'expand_dims' and 'broadcast_all' call it once with the whole batch "
            "(docs/transformations.md)")
    (size,) = {arg.shape[d] for arg, d in zip(args, dims) if d is not None}
    args = [arg if d is None else batching.moveaxis(arg, d, 0) for arg, d in zip(args, dims)]
    if vmap_method in ("sequential", "sequential_unrolled"):
        is_batched = [d is not None for d in dims]

        def one_element(_, batched_args):
            batched_args = iter(batched_args)
            merged = [next(batched_args) if b else a for a, b in zip(args, is_batched)]
            return (), outside_call_p.bind(*merged, consumer_id=consumer_id,
                                           result_avals=result_avals, vmap_method=vmap_method,
                                           **params)

        _, outs = jax.lax.scan(one_element, (), [a for a, b in zip(args, is_batched) if b],
                               unroll=vmap_method == "sequential_unrolled")
        return outs, [0] * len(outs)
    if vmap_method in ("expand_dims", "broadcast_all"):
        lead = size if vmap_method == "broadcast_all" else 1
        args = [jax.lax.broadcast(a, (lead,)) if d is None else a for a, d in zip(args, dims)]
    batched_avals = tuple(core.ShapedArray((size, *a.shape), a.dtype) for a in result_avals)
    batched = dataclasses.replace(
        consumer.with_transform(("batch", {"batch_dims": tuple(dims)})),
        result_avals=tuple(((size, *shape), dtype) for shape, dtype in consumer.result_avals))
    outs = outside_call_p.bind(*args, consumer_id=registry.register(batched),
                               result_avals=batched_avals, vmap_method=vmap_method, **params)
    return outs, [0] * len(outs)


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
    and lets only the device at ``device_index`` enqueue it (or, for a call, call the host; the
    others get zeros, and a sum over the devices hands every device the caller's results). XLA's
    Shardy partitioner keeps the maximal sharding JAX uses for this only on JAX's own callback
    targets, so we cannot use it."""
    devices = ctx.module_context.axis_context.device_assignment
    mesh_devices = np.empty(len(devices), dtype=object)
    mesh_devices[:] = list(devices)
    axis = "_hostcallback_devices"
    mesh = jax.sharding.Mesh(mesh_devices, (axis,))
    emit_device = _local_ordinal(devices[device_index])

    def tap_on_every_device(*xs):
        outs = outside_call_p.bind(*xs, device_index=device_index, emit_device=emit_device,
                                   **params)
        if params["result_avals"] is None:
            return outs
        return [_share_from_caller(out, axis) for out in outs]

    replicated = jax.sharding.PartitionSpec()
    region = jax.shard_map(tap_on_every_device, mesh=mesh, in_specs=replicated,
                           out_specs=replicated, check_vma=False)
    # The avals may carry the outer computation's sharding; inside the region they are whole.
    region_ctx = dataclasses.replace(ctx, avals_in=_plain(ctx.avals_in),
                                     avals_out=_plain(ctx.avals_out))
    outs = mlir.lower_fun(region, multiple_results=True)(region_ctx, *args)
    if region_ctx.tokens_out is not None:
        ctx.set_tokens_out(region_ctx.tokens_out)
    return outs


def _plain(avals):
    return [core.ShapedArray(a.shape, a.dtype) for a in avals]


def _share_from_caller(x, axis_name):
    """x on the calling device, zeros on the others -> x on every device, bit for bit (a sum of
    the bit patterns; complex numbers as two real halves)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return jax.lax.psum(x.astype(np.uint8), axis_name).astype(np.bool_)
    if dtype.kind == "c":
        return jax.lax.complex(_share_from_caller(jax.lax.real(x), axis_name),
                               _share_from_caller(jax.lax.imag(x), axis_name))
    bits = np.dtype(f"uint{8 * dtype.itemsize}")
    summed = jax.lax.psum(jax.lax.bitcast_convert_type(x, bits), axis_name)
    return jax.lax.bitcast_convert_type(summed, dtype)


def _check_device_index(device_index: int, num_devices: int) -> None:
    if not 0 <= device_index < num_devices:
        raise ValueError(
            f"device_index={device_index} is out of range for a computation on {num_devices} "
            f"device(s): it picks one of the computation's devices, 0 to {num_devices - 1}")


# Per MLIR module being lowered: block -> token of the last tap emitted in that block.
_token_chains: weakref.WeakKeyDictionary[ir.Module, dict] = weakref.WeakKeyDictionary()


def _token_chain(ctx) -> dict:
    return _token_chains.setdefault(ctx.module_context.module, {})


def _lowering(ctx, *args, consumer_id, transport, ordered, device_index, emit_device,
              result_avals, timeout_s, platform, flavor, vmap_method):
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
    elif isinstance(axis_context, sharding_impls.ShardingContext):
        _check_device_index(device_index, axis_context.num_devices)
        if axis_context.num_devices > 1:
            return _lower_in_manual_region(
                ctx, args, consumer_id=consumer_id, transport=transport, ordered=ordered,
                device_index=device_index, result_avals=result_avals, timeout_s=timeout_s,
                flavor=flavor, vmap_method=vmap_method)
    emit = emitter_for(transport, platform)
    if ordered:
        # JAX threads this token through loops, branches and calls: strict program order.
        token = ctx.tokens_in.get(ordered_tap_effect)
    else:
        # Our own chain: program order among the taps of one block (straight-line code).
        block = ir.InsertionPoint.current.block
        token = _token_chain(ctx).get(block) or mlir.hlo.create_token()
    if is_call:
        token, outs = emit.call(ctx, list(args), consumer_id=consumer_id,
                                emit_device=emit_device, token=token,
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
