"""Ready means handled: a tapped computation ends only once its taps have been handled.

Each computation that holds taps begins with ``fence_begin_p`` and ends with ``fence_end_p``,
two equations that program_order.py puts around its jaxpr. Both take part in the program-order
chain of its taps, so the begin comes before the first tap and the end after the last, on every
device that runs the computation. They lower to ``hostcallback_begin`` and ``hostcallback_fence``
(_native/ffi_handlers.cc): the fence waits until the device's receiver has handled every tap
enqueued so far, so ``block_until_ready()``, ``np.asarray(result)`` and anything else that waits
for the results also waits for the taps, as it does for JAX's own callbacks. A receiver that has
caught up costs the fence one lock; one that has not is woken at once. A receiver stuck in one
consumer for 5 s lets the fence go on (the consumer may wait for this computation's results).
The pair also tells barriers which tapped computations run on a device
(_native/computations.h), whichever thread dispatched them.

``configure(delivery="dispatch")`` also registers a host callback that is never called with the
computation: jaxlib then runs it while dispatching it on CPU, as it runs computations with JAX's
own callbacks, so the dispatching call returns only once its taps were handled.
``configure(delivery="async")`` (``HOSTCALLBACK_DELIVERY=async``) lowers both to nothing in the
computations compiled after it: results are ready as soon as the device is done, and the taps
are delivered behind them. On a CUDA GPU with HOSTCALLBACK_GPU_FENCE=1 the begin writes a 0 id
and the fence makes the stream wait for a word that the device's committer writes once the taps
were handled (the stream waits there; XLA's launching thread goes on), and "dispatch" means
"handled"; without it a GPU's results are ready as with "async". On TPU and ROCm, with
HOSTCALLBACK_CALLBACK_FENCE=1 (also until measured there), the fence is one of JAX's host
callbacks with an answer, which waits for the taps in Python (transport/callback.py) while the
device waits for the answer, and there is no begin. This module only writes computations; it
never waits itself.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import jax
import numpy as np

from hostcallback import _jax as jx
from hostcallback import config
from hostcallback._jax import mlir
from hostcallback._native import outfeed
from hostcallback._trace import regions, transport

BEGIN_TARGET = "hostcallback_begin"
FENCE_TARGET = "hostcallback_fence"
# A computation's id, as its begin hands it to its fence: the low 32 bits of the core's id.
ID_AVAL = jx.ShapedArray((), np.uint32)

# XLA's CPU client runs a computation of fewer than 1000 floating-point operations while it is
# dispatched, on the dispatching thread: a fenced one would make the dispatch itself wait for
# its taps. The fence takes a sum of this many values made from the computation's id, which XLA
# can neither fold nor skip, so that every fenced computation is dispatched asynchronously.
_WEIGHT_ELEMENTS = 2048
_WEIGHT_AVAL = jx.ShapedArray((), np.uint32)

_lower_begin = jax.ffi.ffi_lowering(BEGIN_TARGET, has_side_effect=True)
_lower_fence = jax.ffi.ffi_lowering(FENCE_TARGET, has_side_effect=True)

fence_begin_p = jx.Primitive("hostcallback_fence_begin")
fence_end_p = jx.Primitive("hostcallback_fence_end")
fence_end_p.multiple_results = True


# Per MLIR module being lowered: the delivery its begin was lowered with, so that its end keeps
# it even if configure() changes the setting meanwhile (a begin without its fence would leave a
# computation running for good).
_deliveries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The GPU fence (the stream waits until the receiver has handled the computation's taps,
# _native/cuda_commit.h) runs only where HOSTCALLBACK_GPU_FENCE=1 asks for it (tests/gpu and
# bench/gpu_check.sh do): measured on an H200 it adds about 8 % more to a 1.5 ms step than the
# taps alone, and a consumer that moves GPU arrays (jax.device_get) waits for the stream, which
# waits for the consumer until its patience (5 s) runs out. Without it a GPU's results are ready
# before their taps were handled, as with delivery="async" (the architecture document, "On a
# GPU").
GPU_FENCE = config.env_bool("HOSTCALLBACK_GPU_FENCE", False)
# Where the begin and the fence have handlers: the CPU's run on XLA's device thread; on a CUDA GPU
# "dispatch" is "handled".
FENCED_PLATFORMS = ((frozenset({outfeed.NATIVE_PLATFORM})
                     | (transport.NATIVE_GPU_PLATFORMS if GPU_FENCE else frozenset()))
                    if transport.NATIVE_PLATFORMS else frozenset())
# On TPU and ROCm, where the callback transport serves, the fence is one of JAX's host callbacks
# that waits for the taps in Python (transport/callback.py: lower_fence), with no begin (barriers
# do not see those computations running; their results, and the markers behind them, bring them
# along). It makes every execution of a tapped computation wait for a host round trip per
# device, taps fired or not, which has not been measured on a TPU: until it has, it runs only
# where HOSTCALLBACK_CALLBACK_FENCE=1 asks for it, and results are ready there as with
# delivery="async", as JAX's own callbacks' are on TPU.
CALLBACK_FENCE = config.env_bool("HOSTCALLBACK_CALLBACK_FENCE", False)
CALLBACK_FENCED_PLATFORMS = frozenset({"tpu", "rocm"}) if CALLBACK_FENCE else frozenset()


def _delivery(ctx) -> str:
    """The module's delivery: "async" for a module lowered for several platforms at once."""
    module = ctx.module_context.module
    if module not in _deliveries:
        platforms = ctx.module_context.platforms
        delivery = config.settings.delivery if len(platforms) == 1 else "async"
        if delivery == "dispatch" and platforms[0] != outfeed.NATIVE_PLATFORM:
            delivery = "handled"
        _deliveries[module] = delivery
    return _deliveries[module]


def _fenced(ctx) -> bool:
    platform = ctx.module_context.platforms[0]
    return _delivery(ctx) != "async" and (platform in FENCED_PLATFORMS
                                          or platform in CALLBACK_FENCED_PLATFORMS)


def _native(ctx) -> bool:
    """Whether the fence has our native handlers here; elsewhere JAX's host callbacks serve."""
    return ctx.module_context.platforms[0] in FENCED_PLATFORMS


def _on_every_device(ctx, primitive, args, **params):
    """In a jit that XLA partitions over several devices, each device runs the op on its own
    (regions.py, as a whole-value tap does), else None."""
    axis_context = ctx.module_context.axis_context
    if not (isinstance(axis_context, jx.ShardingContext) and axis_context.num_devices > 1):
        return None
    body = (lambda *xs: primitive.bind(*xs, **params)) if primitive.multiple_results else (
        lambda *xs: [primitive.bind(*xs, **params)])
    outs, tokens = regions.on_every_device(ctx, ctx.tokens_in, body, args, ctx.avals_in,
                                           ctx.avals_out)
    ctx.set_tokens_out(tokens)
    return outs


def _chain_tokens(ctx, effects) -> list:
    return [ctx.tokens_in.get(effect) for effect in effects if effect in ctx.tokens_in.effects()]


def _pass_tokens(ctx, effects, token) -> None:
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet(
        {effect: token for effect in effects if effect in ctx.tokens_in.effects()})))


def _manual_sharding(ctx, ranks):
    """The op's sharding inside a manual region (shard_map: each device on its own), else None."""
    if isinstance(ctx.module_context.axis_context, jx.SPMDAxisContext):
        return jx.manual_sharding(ranks)
    return None


def _manual(ctx, op, ranks) -> None:
    if (sharding := _manual_sharding(ctx, ranks)) is not None:
        jx.set_sharding(ctx.module_context, op, sharding)


# ---- the begin ---------------------------------------------------------------------------------


def _begin_abstract_eval(*, chains):
    return ID_AVAL, set(chains)


fence_begin_p.def_effectful_abstract_eval(_begin_abstract_eval)


# When a computation whose begin counts it among its devices' running ones (the CPU's begin; a
# GPU's hands out no id) was last lowered (monotonic): its first run may begin well after its
# dispatch, which barriers allow for (lifecycle.py).
last_counted_lowering: float | None = None


def _begin_lowering(ctx, *, chains):
    global last_counted_lowering
    if not (_fenced(ctx) and _native(ctx)):  # a fence on JAX's callbacks needs no begin
        ctx.set_tokens_out(ctx.tokens_in)
        return [mlir.ir_constant(np.uint32(0))]
    if tuple(ctx.module_context.platforms) == (outfeed.NATIVE_PLATFORM,):
        last_counted_lowering = time.monotonic()
    outs = _on_every_device(ctx, fence_begin_p, [], chains=chains)
    if outs is not None:
        return outs
    (token,) = _chain_tokens(ctx, chains)[:1] or [jx.hlo.create_token()]
    call_ctx = dataclasses.replace(ctx, avals_in=[jx.abstract_token],
                                   avals_out=[jx.abstract_token, ID_AVAL])
    token_out, ident = _lower_begin(call_ctx, token)
    _manual(ctx, token_out.owner, [0, 0])
    if _delivery(ctx) == "dispatch":
        jx.run_synchronously(ctx)
    _pass_tokens(ctx, chains, token_out)
    return [ident]


mlir.register_lowering(fence_begin_p, _begin_lowering, cacheable=False)

# ---- the end -----------------------------------------------------------------------------------


def _end_abstract_eval(ident, *, chains):
    return [], set(chains)


fence_end_p.def_effectful_abstract_eval(_end_abstract_eval)


def _end_lowering(ctx, ident, *, chains):
    if not _fenced(ctx):
        ctx.set_tokens_out(ctx.tokens_in)
        return []
    outs = _on_every_device(ctx, fence_end_p, [ident], chains=chains)
    if outs is not None:
        return []
    tokens = _chain_tokens(ctx, chains) or [jx.hlo.create_token()]
    if not _native(ctx):
        token = tokens[0] if len(tokens) == 1 else jx.hlo.after_all(tokens)
        token_out = transport.callback.lower_fence(
            ctx, token, op_sharding=_manual_sharding(ctx, [0, 0]))
        _pass_tokens(ctx, chains, token_out)
        return []
    call_ctx = dataclasses.replace(
        ctx, avals_in=[jx.abstract_token] * len(tokens) + [ID_AVAL, _WEIGHT_AVAL],
        avals_out=[jx.abstract_token])
    (token_out,) = _lower_fence(call_ctx, *tokens, ident, _weight(ident))
    _manual(ctx, token_out.owner, [0])
    _pass_tokens(ctx, chains, token_out)
    return []


mlir.register_lowering(fence_end_p, _end_lowering, cacheable=False)


def _weight(ident):
    """sum(iota(_WEIGHT_ELEMENTS) + ident): _WEIGHT_ELEMENTS operations on run-time data."""
    u32 = jx.ir.IntegerType.get_unsigned(32)
    vector = jx.ir.RankedTensorType.get([_WEIGHT_ELEMENTS], u32)
    scalar = jx.ir.RankedTensorType.get([], u32)
    values = jx.hlo.add(jx.hlo.iota(vector, 0), jx.hlo.broadcast_in_dim(vector, ident, []))
    zero = mlir.ir_constant(np.uint32(0))
    reduce = jx.hlo.ReduceOp([scalar], [values], [zero], [0])
    block = reduce.regions[0].blocks.append(scalar, scalar)
    with jx.ir.InsertionPoint(block):
        jx.hlo.return_([jx.hlo.add(*block.arguments)])
    return reduce.result


def around(eqns: list, effects: frozenset, make_eqn) -> list:
    """``eqns`` between a begin and an end that take part in the chains of ``effects``;
    ``make_eqn(invars, outvars, primitive, params)`` builds an equation."""
    ident = jx.Var(ID_AVAL)
    params = {"chains": tuple(sorted(effects, key=str))}
    return [make_eqn([], [ident], fence_begin_p, params), *eqns,
            make_eqn([ident], [], fence_end_p, params)]
