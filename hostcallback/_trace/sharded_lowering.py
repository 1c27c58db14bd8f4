"""Lowering a tap or call inside a jit that XLA partitions automatically over several devices.

Shardy keeps the maximal sharding JAX uses for "run this once, on one device" only on JAX's own
callback targets, so we build the two forms ourselves:

- whole value (the default, as legacy and jax.debug.callback): a shard_map over all devices, in
  which every device sees the whole value and only the device at ``device_index`` enqueues it
  (or, for a call, calls the host; the others get zeros, and a sum over the devices hands every
  device the caller's results, bit for bit).
- a call on the devices of this process alone (native transport): a custom_partitioning op that
  leaves the operands where XLA put them and meets in our handler, not in XLA's collectives
  (lower_shared_call). XLA's CPU client sometimes leaves one device's part of a step unstarted
  while the others wait in a collective, and ends the process after its rendezvous limit; our
  handler fails the computation within the call's timeout instead.
- ``partitioned=True`` (taps): a custom_partitioning op that XLA splits like its operands; each
  device taps its own shard, nothing is gathered, and the consumer learns the shard's place from
  a ``("shard", ...)`` transform.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning

from hostcallback import _jax as jx
from hostcallback._jax import ir, mlir
from hostcallback._records.registry import registry
from hostcallback._trace import regions
from hostcallback._trace.program_order import ordered_tap_effect, program_order_effect
from hostcallback._trace.transport import emitter_for, native, register_lowering
from hostcallback.flavors import CallbackFlavor

NO_LOCAL_DEVICE = -2  # emit_device: the chosen device belongs to another process


def local_ordinal(device) -> int:
    """The ordinal XLA gives the FFI handler for a device, or NO_LOCAL_DEVICE if it is remote."""
    if device.process_index != jax.process_index():
        return NO_LOCAL_DEVICE
    return device.id


manual_sharding = jx.manual_sharding


def num_devices(axis_context) -> int:
    """How many devices run the computation being lowered (1 where it is not partitioned)."""
    if isinstance(axis_context, jx.SPMDAxisContext):
        return axis_context.mesh.size
    if isinstance(axis_context, jx.ShardingContext):
        return axis_context.num_devices
    return getattr(getattr(axis_context, "axis_env", None), "nreps", 1)


def check_device_index(device_index: int, num_devices: int) -> None:
    if not 0 <= device_index < num_devices:
        raise ValueError(
            f"device_index={device_index} is out of range for a computation on {num_devices} "
            f"device(s): it picks one of the computation's devices, 0 to {num_devices - 1}")


def _plain(avals):
    return [jx.ShapedArray(a.shape, a.dtype) for a in avals]


def lower_on_one_device(ctx, args, outside_call_p, *, device_index, **params):
    """The whole-value form (see the module docstring) of a tap or call of ``outside_call_p``."""
    devices = ctx.module_context.axis_context.device_assignment
    emit_device = local_ordinal(devices[device_index])

    def tap_on_every_device(*xs):
        if params["result_avals"] is None:
            return outside_call_p.bind(*xs, device_index=device_index, emit_device=emit_device,
                                       **params)
        # A call: the caller's results reach every device through a sum, which waits for all
        # of them. So the caller never fails alone (the others would wait in the sum forever):
        # it returns zeros and a failure flag, and every device fails together after the sum.
        call_params = dict(params, result_avals=(*params["result_avals"], _FAILURE_FLAG))
        *outs, failed = outside_call_p.bind(*xs, device_index=device_index,
                                            emit_device=emit_device, **call_params)
        shared = [_share_from_caller(out, regions.AXIS) for out in outs]
        # The check passes the flag through too, and the region returns it, so that the check
        # is kept also for a call without results; the lowering drops it again.
        checked_flag, *checked = shared_call_check_p.bind(
            jax.lax.psum(failed, regions.AXIS), *shared, consumer_id=params["consumer_id"],
            transport=params["transport"])
        return [*checked, checked_flag]

    # The avals may carry the outer computation's sharding; inside the region they are whole.
    is_call = params["result_avals"] is not None
    region_args = args if is_call else [jx.propagating_forward_only(a) for a in args]
    outs, tokens = regions.on_every_device(
        ctx, ctx.tokens_in, tap_on_every_device, region_args, _plain(ctx.avals_in),
        _plain(ctx.avals_out) + ([_FAILURE_FLAG] if is_call else []))
    ctx.set_tokens_out(tokens)
    # A tap hands on its operands as they came, keeping their sharding: the region's results
    # are whole on every device, and would make what follows the tap replicated.
    return outs[:-1] if is_call else list(args)


_FAILURE_FLAG = jx.ShapedArray((), np.uint32)  # the last result of a shared call (native.py)

# After a shared call: fails every device with the call's reason if the summed flag says it
# failed, else passes the flag and the shared results through (transport/native.py,
# transport/callback.py).
shared_call_check_p = jx.Primitive("hostcallback_shared_call_check")
shared_call_check_p.multiple_results = True
shared_call_check_p.def_abstract_eval(
    lambda *operands, **params: [jx.ShapedArray(v.shape, v.dtype) for v in operands])


def _check_lowering(ctx, failed, *values, consumer_id, transport, platform):
    op_sharding = None
    if isinstance(ctx.module_context.axis_context, jx.SPMDAxisContext):
        op_sharding = manual_sharding([v.ndim for v in ctx.avals_out])
    return emitter_for(transport, platform).lower_check(ctx, failed, list(values),
                                                  consumer_id=consumer_id,
                                                  op_sharding=op_sharding)


register_lowering(shared_call_check_p, _check_lowering)


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


def meets_in_handler(ctx, emit) -> bool:
    """Whether a call in this sharded jit can meet in the transport's handler: a native one, on
    devices of this process alone (the handler sees no other), with plain arrays."""
    devices = ctx.module_context.axis_context.device_assignment
    return (emit is native
            and all(d.process_index == jax.process_index() for d in devices)
            and not any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
                        for a in [*ctx.avals_in, *ctx.avals_out]))


_DONE = jx.ShapedArray((), np.uint32)  # the last result of a shared call's handler (native.py)


def lower_shared_call(ctx, args, outside_call_p, *, device_index, **params):
    """A call shared over the devices of this sharded jit, met in the handler (module docstring):
    each device's part brings its own shard of the operands, where XLA put them, and gets the
    whole answer; the host assembles the shards. Ordered after the taps before it and before
    those after it by order points on every device (order_p), which carry the token."""
    devices = ctx.module_context.axis_context.device_assignment
    emit_device = devices[device_index].id
    consumer_id, result_avals = params.pop("consumer_id"), tuple(params.pop("result_avals"))
    params.pop("emit_device")
    effect = ordered_tap_effect if params["ordered"] else program_order_effect
    threaded = effect in ctx.tokens_in.effects()
    # Inside the op nothing threads tokens: the order points do, around it.
    params.update(flavor=CallbackFlavor.PURE.value, ordered=False)
    tokens = ctx.tokens_in
    operands, operand_avals = list(args), _plain(ctx.avals_in)
    if threaded or not operands:  # one more operand: what orders it, or what XLA partitions by
        if threaded:
            (after_taps,), tokens = regions.on_every_device(
                ctx, tokens, lambda: order_p.bind(effect=effect), [], [], [_DONE])
        else:
            after_taps = mlir.ir_constant(np.uint32(0))
        operands.append(after_taps)
        operand_avals.append(_DONE)

    def call_whole(*xs):  # what the op means; XLA asks partition() how to run it per device
        return tuple(outside_call_p.bind(
            *xs, consumer_id=consumer_id, device_index=device_index,
            emit_device=emit_device, result_avals=(*result_avals, _DONE), **params))

    def partition(mesh, arg_shapes, result_shape):
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        # A leaf XLA splits unevenly (padded shards) is gathered by XLA first: the host could
        # not place padded shards.
        shardings = tuple(a.sharding if _splits_evenly(a) else replicated for a in arg_shapes)
        parts = sorted(shardings[0].device_set, key=lambda d: d.id)
        plan = _send_plan(shardings, [a.shape for a in arg_shapes], parts, len(args))
        gather_id = registry.register(dataclasses.replace(
            registry.get(consumer_id), gathered=plan.gathered))

        def call_with_own_shard(*shards):
            return tuple(outside_call_p.bind(
                *shards, consumer_id=gather_id, device_index=device_index,
                emit_device=emit_device, result_avals=(*result_avals, _DONE),
                **dict(params, shared_parts=tuple(d.id for d in parts),
                       shared_sends=plan.sends)))

        return (mesh, call_with_own_shard, tuple(replicated for _ in result_shape), shardings)

    def replicated_results(mesh, arg_shapes, result_shape):
        return tuple(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                     for _ in result_shape)

    operand_factors = tuple(tuple(f"a{leaf}d{dim}" for dim in range(a.ndim))
                            for leaf, a in enumerate(operand_avals))
    result_factors = tuple(tuple(f"r{leaf}d{dim}" for dim in range(a.ndim))
                           for leaf, a in enumerate((*result_avals, _DONE)))
    op = custom_partitioning(call_whole)
    op.def_partition(
        partition=partition, infer_sharding_from_operands=replicated_results,
        sharding_rule=SdyShardingRule(operand_mappings=operand_factors,
                                      result_mappings=result_factors))
    op_ctx = dataclasses.replace(ctx, avals_in=operand_avals,
                                 avals_out=[*_plain(result_avals), _DONE])
    *outs, done = mlir.lower_fun(lambda *xs: list(op(*xs)), multiple_results=True)(op_ctx,
                                                                                   *operands)
    # custom_partitioning's op declares no side effect; a call whose result is unused must stay.
    done.owner.attributes["has_side_effect"] = ir.BoolAttr.get(True)
    jx.run_synchronously(ctx)  # as a call on one device (native.lower_call)
    if threaded:  # the taps after it come after its answer, on every device
        _, tokens = regions.on_every_device(ctx, tokens, lambda d: order_p.bind(d, effect=effect),
                                     [done], [_DONE], [_DONE])
    ctx.set_tokens_out(tokens)
    return outs


def _splits_evenly(arg_shape) -> bool:
    try:
        arg_shape.sharding.shard_shape(tuple(arg_shape.shape))
    except ValueError:  # jax's IndivisibleError
        return False
    return True


@dataclasses.dataclass(frozen=True)
class _SendPlan:
    sends: tuple  # sends[p * operands + i]: whether the p-th device sends operand i
    gathered: tuple  # Consumer.gathered: how the host puts the whole values together


def _send_plan(shardings, shapes, parts, leaves: int) -> _SendPlan:
    """Which device sends which operand: of the devices that hold the same shard of a leaf, the
    first; the operand that only orders the call (past ``leaves``), none. The host gets, device
    by device, the shards that device sends, and where each goes."""
    operands = len(shardings)
    sends = [0] * (len(parts) * operands)
    pieces = []  # (device position, leaf, offset), in the order the host gets them
    for leaf in range(leaves):
        shape = tuple(shapes[leaf])
        indices = shardings[leaf].devices_indices_map(shape)
        seen = set()
        for position, device in enumerate(parts):
            starts = _starts(indices[device], shape)
            if starts in seen:
                continue
            seen.add(starts)
            sends[position * operands + leaf] = 1
            pieces.append((position, leaf, starts))
    pieces.sort(key=lambda piece: piece[:2])
    gathered = (tuple(tuple(s) for s in shapes[:leaves]),
                tuple((leaf, starts) for _, leaf, starts in pieces))
    return _SendPlan(tuple(sends), gathered)


# A point in the program order on one device: a uint32 zero after the taps before it, or, given
# values, only the token, after them (native.lower_order).
order_p = jx.Primitive("hostcallback_order")
order_p.multiple_results = True
order_p.def_effectful_abstract_eval(lambda *values, effect: ([_DONE], {effect}))


def _order_lowering(ctx, *values, effect, platform):
    del platform  # order points exist only where calls meet in the native handler
    token, zero = native.lower_order(
        ctx, list(values), token=ctx.tokens_in.get(effect),
        op_sharding=manual_sharding([0, 0]) if isinstance(ctx.module_context.axis_context,
                                                          jx.SPMDAxisContext) else None)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({effect: token})))
    return [zero]


register_lowering(order_p, _order_lowering)


def _starts(index, shape) -> tuple:
    """Where a shard (its slices of the whole value, from devices_indices_map) begins."""
    return tuple(s.indices(n)[0] for s, n in zip(index, shape))


def shard_transform(shardings, global_shapes, device) -> tuple:
    """("shard", {...}) for the shards one device holds: per leaf, the block index, the global
    offset of its first element, and the whole value's shape."""
    index, offset = [], []
    for sharding, shape in zip(shardings, global_shapes):
        starts = _starts(sharding.devices_indices_map(tuple(shape))[device], shape)
        sizes = sharding.shard_shape(tuple(shape))
        offset.append(starts)
        index.append(tuple(start // size if size else 0 for start, size in zip(starts, sizes)))
    return ("shard", {"index": tuple(index), "offset": tuple(offset),
                      "global_shape": tuple(tuple(s) for s in global_shapes)})


def lower_partitioned(ctx, args, outside_call_p, *, consumer_id, **params):
    """The per-shard form (see the module docstring) of a tap of ``outside_call_p``."""
    def tap_whole(*xs):  # what the op means; XLA asks partition() how to run it per shard
        return tuple(outside_call_p.bind(*xs, consumer_id=consumer_id, **params))

    def partition(mesh, arg_shapes, result_shape):
        shardings = tuple(a.sharding for a in arg_shapes)
        shapes = tuple(a.shape for a in arg_shapes)
        consumer = registry.get(consumer_id)
        try:
            per_device = tuple((d.id, shard_transform(shardings, shapes, d))
                               for d in shardings[0].device_set)
        except ValueError as error:  # jax's IndivisibleError: shards of unequal size
            raise ValueError(
                f"hostcallback: a partitioned=True tap needs shards of equal size, and a value "
                f"of shape {shapes} does not split evenly over its devices ({error}). Pad it to "
                "a multiple of the mesh axes, or tap the whole value (partitioned=False)."
            ) from None
        shard_consumer = dataclasses.replace(consumer, per_device_transforms=per_device)
        shard_id = registry.register(shard_consumer)

        def tap_own_shard(*xs):
            # Without an effect: the per-shard module XLA builds has no program-order token to
            # thread (JAX 0.8 would look for one), and its outputs are the op's, so it stays.
            return tuple(outside_call_p.bind(*xs, consumer_id=shard_id,
                                             **dict(params, flavor=CallbackFlavor.PURE.value)))

        return mesh, tap_own_shard, shardings, shardings

    # Each result is its operand: dimension d of leaf l is one factor on both sides.
    factors = tuple(tuple(f"l{leaf}d{dim}" for dim in range(a.ndim))
                    for leaf, a in enumerate(ctx.avals_in))
    op = custom_partitioning(tap_whole)
    op.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: tuple(
            a.sharding for a in arg_shapes),
        sharding_rule=SdyShardingRule(operand_mappings=factors, result_mappings=factors))
    plain_ctx = dataclasses.replace(ctx, avals_in=_plain(ctx.avals_in),
                                    avals_out=_plain(ctx.avals_out))
    outs = mlir.lower_fun(lambda *xs: list(op(*xs)), multiple_results=True)(plain_ctx, *args)
    # custom_partitioning's op declares no side effect; a tap whose result is unused must stay.
    outs[0].owner.attributes["has_side_effect"] = ir.BoolAttr.get(True)
    return outs
