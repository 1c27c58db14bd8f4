"""The ``outside_call`` primitive: a tap that hands its operands to the host and returns them.

Its rules sit below its definition, top to bottom: effects, abstract eval, dead-code
elimination, batching (vmap_method for calls), jvp, transpose (taps on tangents), the remat split
(replays), lowering (sharded jits in sharded_lowering.py).

A tap declares ProgramOrderEffect, an ordered effect that JAX threads through loops, branches
and calls, so the taps of a computation reach the host in program order; program_order.py keeps
the effect out of the computation's top level, so JAX's fast dispatch path stays (see there). An
``ordered=True`` tap declares a strict ordered effect instead, whose token JAX also passes between
computations at run time: order across computations, at JAX's dispatch cost. A PURE tap declares
none. A tap is kept alive by its effect, its own DCE rule, and keep_taps.py for the control flow
around it.
"""

from __future__ import annotations

import dataclasses
import weakref

import jax

from hostcallback import _jax as jx
from hostcallback._jax import ad, batching, ir, mlir, patches
from hostcallback._native import outfeed
from hostcallback._records.registry import DEBUG_CALLBACK_API, registry
from hostcallback._trace import compile_rescue, keep_taps, sharded_lowering
from hostcallback._trace.program_order import ordered_tap_effect, program_order_effect
from hostcallback._trace.transport import emitter_for, register_lowering
from hostcallback.flavors import VMAP_METHODS, CallbackFlavor

outside_call_p = jx.Primitive("outside_call")
outside_call_p.multiple_results = True
patches.require_devices_during_lowering(outside_call_p)
keep_taps.register_tap_primitive(outside_call_p)
compile_rescue.install()

PURE = CallbackFlavor.PURE.value  # JAX may drop such a callback when its result is unused
_SKIPPED = "skipped"  # the replayed copy of a replays="skip" tap: lowers to nothing
# shard_callback: the host callback a partitioned tap's shards call (callback transport), or none.
NO_SHARD_CALLBACK = -1
# shared_parts: (), or (one device's part of a call shared over the devices of a sharded jit, met
# in the native handler: sharded_lowering.lower_shared_call) the ids of the devices that share
# it, and shared_sends which of them sends which operand.


def params_of(*, consumer_id: int, transport: str, ordered: bool = False,
              device_index: int = 0, result_avals: tuple | None = None, timeout_s: float = 0.0,
              flavor: str = "io_callback", vmap_method: str | None = None,
              partitioned: bool = False, replays: str = "deliver") -> dict:
    """Every param of a tap or call as traced; those only its lowering sets at their defaults."""
    return dict(consumer_id=consumer_id, transport=transport, ordered=ordered,
                device_index=device_index, emit_device=outfeed.ALL_DEVICES,
                result_avals=result_avals, timeout_s=timeout_s, flavor=flavor,
                vmap_method=vmap_method, partitioned=partitioned, replays=replays,
                shard_callback=NO_SHARD_CALLBACK, shared_parts=(), shared_sends=())


def bind(leaves, **params):
    """A tap (result_avals None: returns the leaves) or a call (returns arrays of result_avals);
    params as params_of takes them."""
    return outside_call_p.bind(*leaves, **params_of(**params))


# ---- effects: ProgramOrderEffect by default, OrderedTapEffect for ordered=True, none for PURE;
# both are defined, and kept off a computation's top level, in program_order.py.


# ---- evaluation ------------------------------------------------------------------------------


def _impl(*args, **params):
    return jx.apply_primitive(outside_call_p, *args, **params)


outside_call_p.def_impl(_impl)


def _abstract_eval(*avals, ordered, result_avals, flavor, **params):
    outs = avals if result_avals is None else result_avals
    if ordered:
        return outs, {ordered_tap_effect}
    if flavor == PURE:  # JAX may drop it, so it takes no part in the order either
        return outs, jx.no_effects
    return outs, {program_order_effect}


outside_call_p.def_effectful_abstract_eval(_abstract_eval)


def _dce_rule(used_outputs, eqn):
    # A tap is a side effect: it stays even when nothing uses what it returns. A PURE one is not.
    if eqn.params["flavor"] == PURE and not any(used_outputs):
        return [False] * len(eqn.invars), None
    return [True] * len(eqn.invars), eqn


patches.set_dce_rule(outside_call_p, _dce_rule)


# ---- transformations ------------------------------------------------------------------------


def _batching_rule(args, dims, *, consumer_id, **params):
    """A tap: one tap of the whole batch; the consumer learns which axis of each leaf is the
    batch. A call: as its vmap_method says. (hostcallback.debug's callbacks are JAX's own until
    they are lowered: JAX's rule batches them.)"""
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
    if consumer.jax_api == "io_callback" and params["ordered"]:
        raise ValueError("Cannot `vmap` ordered IO callback.")
    if vmap_method is None and consumer.jax_api:
        raise NotImplementedError(
            f"vmap is only supported for the {consumer.jax_api} primitive when vmap_method is "
            "one of 'sequential', 'sequential_unrolled', 'expand_dims', 'broadcast_all', or "
            f"'legacy_vectorized'. Got {vmap_method=}.")
    if vmap_method is None:
        raise NotImplementedError(
            f"vmap of hostcallback.call ({consumer.name}) needs a vmap_method: one of "
            f"{', '.join(map(repr, VMAP_METHODS))}. 'sequential' calls the host once per batch "
            "element; 'expand_dims' and 'broadcast_all' call it once with the whole batch "
            "(see \"Taps and calls under JAX transformations\" in the documentation)")
    (size,) = {arg.shape[d] for arg, d in zip(args, dims) if d is not None}
    args = [arg if d is None else jx.moveaxis(arg, d, 0) for arg, d in zip(args, dims)]
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
    batched_avals = tuple(jx.ShapedArray((size, *a.shape), a.dtype) for a in result_avals)
    batched = dataclasses.replace(
        consumer.with_transform(("batch", {"batch_dims": tuple(dims)})),
        result_avals=tuple(((size, *shape), dtype) for shape, dtype in consumer.result_avals))
    outs = outside_call_p.bind(*args, consumer_id=registry.register(batched),
                               result_avals=batched_avals, vmap_method=vmap_method, **params)
    return outs, [0] * len(outs)


batching.primitive_batchers[outside_call_p] = _batching_rule


def _jvp_rule(primals, tangents, **params):
    """The tap fires once, on primal values; tangents pass through untouched."""
    jax_api = registry.get(params["consumer_id"]).jax_api
    if jax_api == "pure_callback":
        raise ValueError("Pure callbacks do not support JVP. Please use `jax.custom_jvp` to use "
                         "callbacks while taking gradients.")
    if jax_api == "io_callback":
        raise ValueError("IO callbacks do not support JVP.")
    if params["result_avals"] is not None:
        raise TypeError(
            f"hostcallback.call ({registry.get(params['consumer_id']).name}) cannot be "
            "differentiated: JAX cannot see inside host code. Wrap it in jax.custom_vjp and "
            "compute the backward pass yourself (it may be another call); see \"Taps and calls "
            "under JAX transformations\" in the documentation")
    return outside_call_p.bind(*primals, **params), tangents


ad.primitive_jvps[outside_call_p] = _jvp_rule


def _transpose_rule(cotangents, *args, consumer_id, **params):
    """A tap on tangent values (in a custom_jvp rule) runs backwards: it taps the cotangents,
    with ("transpose", {}) in its transforms, and passes them on, as legacy host_callback did."""
    jax_api = registry.get(consumer_id).jax_api
    if jax_api == "pure_callback":
        raise ValueError("Pure callbacks do not support transpose. Please use `jax.custom_vjp` "
                         "to use callbacks while taking gradients.")
    if jax_api == "io_callback":
        raise ValueError("IO callbacks do not support transpose.")
    if params["result_avals"] is not None:
        raise TypeError("hostcallback.call cannot be transposed; see \"Taps and calls under JAX "
                        "transformations\" in the documentation")
    cotangents = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cotangents]
    transposed = registry.get(consumer_id).with_transform(("transpose", {}))
    outs = outside_call_p.bind(*cotangents, consumer_id=registry.register(transposed), **params)
    return [out if ad.is_undefined_primal(arg) else None for out, arg in zip(outs, args)]


ad.primitive_transposes[outside_call_p] = _transpose_rule


def _remat_rule(saveable, unknowns_in, instantiated_in, eqn):
    """Splits a tap between the forward pass and jax.checkpoint's recomputation. A tap on known
    values runs in the forward pass; when its outputs are recomputed rather than saved, the
    recomputed copy is a replay, which fires again (replays="deliver", as legacy), fires with
    ("remat_replay", {}) in its transforms ("mark"), or does nothing ("skip")."""
    n = len(eqn.outvars)
    residuals = [v for v, inst in zip(eqn.invars, instantiated_in)
                 if type(v) is jx.Var and not inst]
    if any(unknowns_in):
        return None, eqn, [True] * n, [True] * n, residuals
    if not patches.is_recomputed(saveable(eqn.primitive, *[v.aval for v in eqn.invars],
                                          **eqn.params)):  # saved (or offloaded): no replay
        return eqn, None, [False] * n, [False] * n, []
    params = dict(eqn.params)
    if params["replays"] == "skip":
        params["replays"] = _SKIPPED
    elif params["replays"] == "mark":
        marked = registry.get(params["consumer_id"]).with_transform(("remat_replay", {}))
        params["consumer_id"] = registry.register(marked)
    return eqn, eqn.replace(params=params), [False] * n, [True] * n, residuals


patches.set_remat_rule(outside_call_p, _remat_rule)


# ---- lowering ----------------------------------------------------------------------------------


_EXPORT_MESSAGE = (
    "jax.export cannot serialize a function with a hostcallback {what} ({name}): the exported "
    "program would name a consumer that lives only in this process. Export the function "
    "without it (return the values you want to see as extra outputs), then tap around the "
    "exported call: jax.jit(lambda x: hcb.id_tap(fn, exported.call(x))). See the section "
    "\"jax.export\" in hostcallback's migration guide.")

# Per MLIR module being lowered: block -> token of the last tap emitted in that block.
_token_chains: weakref.WeakKeyDictionary[ir.Module, dict] = weakref.WeakKeyDictionary()


def _token_chain(ctx) -> dict:
    return _token_chains.setdefault(ctx.module_context.module, {})


def _lowering(ctx, *args, platform, **params):
    consumer_id, transport, ordered, emit_device, result_avals, timeout_s = (
        params[k] for k in ("consumer_id", "transport", "ordered", "emit_device", "result_avals",
                            "timeout_s"))
    if params["replays"] == _SKIPPED:
        return list(args)
    is_call = result_avals is not None
    if jx.lowering_for_export(ctx):
        raise NotImplementedError(_EXPORT_MESSAGE.format(
            what="call" if is_call else "tap", name=registry.get(consumer_id).name or "?"))
    emit = emitter_for(transport, platform)  # the transport, picked once for this tap
    axis_context = ctx.module_context.axis_context
    if (ordered and registry.get(consumer_id).jax_api == DEBUG_CALLBACK_API
            and sharded_lowering.num_devices(axis_context) > 1):
        raise ValueError(
            "The following ordered effects are not supported for more than 1 device: "
            "[OrderedDebug]. An ordered jax.debug.callback or print runs on one device only, as "
            "JAX's own does; leave out ordered=True, or tap with hostcallback.id_tap.")
    op_sharding = None
    if isinstance(axis_context, jx.SPMDAxisContext):
        if axis_context.manual_axes != frozenset(axis_context.mesh.axis_names):
            raise NotImplementedError(
                "hostcallback taps inside shard_map need every mesh axis to be manual; with "
                "partially automatic axes, tap outside the shard_map or make all axes manual")
        op_sharding = sharded_lowering.manual_sharding(
            [0] + [a.ndim for a in result_avals or ()])  # the token comes first
    elif isinstance(axis_context, jx.ShardingContext):
        sharded_lowering.check_device_index(params["device_index"], axis_context.num_devices)
        if axis_context.num_devices > 1:
            if params["partitioned"] and not is_call and args:
                shard_callback = emit.shard_callback(ctx)
                if shard_callback is not None:
                    params["shard_callback"] = shard_callback
                return sharded_lowering.lower_partitioned(ctx, args, outside_call_p, **params)
            if is_call and sharded_lowering.meets_in_handler(ctx, emit):
                return sharded_lowering.lower_shared_call(ctx, args, outside_call_p, **params)
            del params["emit_device"]
            return sharded_lowering.lower_on_one_device(ctx, args, outside_call_p, **params)
    # The token that orders this tap after the previous one: JAX threads it through loops,
    # branches and calls (program_order.py); inside a per-shard module XLA builds, or for a PURE
    # tap, our own chain orders the taps of one block.
    effect = ordered_tap_effect if ordered else program_order_effect
    threaded = effect in ctx.tokens_in.effects()
    if threaded:
        token = ctx.tokens_in.get(effect)
    else:
        block = ir.InsertionPoint.current.block
        token = _token_chain(ctx).get(block) or jx.hlo.create_token()
    if is_call and params["shared_parts"]:
        token, outs = emit.lower_shared_call(ctx, list(args), consumer_id=consumer_id,
                                       emit_device=emit_device, parts=params["shared_parts"],
                                       sends=params["shared_sends"],
                                       token=token, op_sharding=op_sharding,
                                       result_avals=result_avals, timeout_s=timeout_s,
                                       name=registry.get(consumer_id).name)
    elif is_call:
        token, outs = emit.lower_call(ctx, list(args), consumer_id=consumer_id,
                                emit_device=emit_device, device_index=params["device_index"],
                                token=token, op_sharding=op_sharding,
                                result_avals=result_avals, timeout_s=timeout_s)
    elif params["shard_callback"] != NO_SHARD_CALLBACK:
        token = emit.lower_tap_shard(ctx, list(args), consumer_id=consumer_id,
                               callback_index=params["shard_callback"], token=token,
                               op_sharding=op_sharding)
        outs = list(args)
    else:
        token = emit.lower_tap(ctx, list(args), consumer_id=consumer_id, emit_device=emit_device,
                         device_index=params["device_index"], token=token,
                         op_sharding=op_sharding)
        outs = list(args)
    if threaded:
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({effect: token})))
    else:
        _token_chain(ctx)[block] = token
    return outs


def _lowering_passing_tokens_on(ctx, *args, platform, **params):
    """A tap that takes no part in the token chain (a skipped replay, a partitioned tap) still
    hands its incoming tokens on, as JAX asks of every rule of an effectful primitive."""
    outs = _lowering(ctx, *args, platform=platform, **params)
    if ctx.tokens_out is None:
        ctx.set_tokens_out(ctx.tokens_in)
    return outs


register_lowering(outside_call_p, _lowering_passing_tokens_on, cacheable=False)

__all__ = ["bind", "outside_call_p"]
