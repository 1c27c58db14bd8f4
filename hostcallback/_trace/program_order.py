"""Program order for taps by default, without leaving JAX's fast dispatch path.

Every tap that is not ``ordered=True`` or PURE declares ``ProgramOrderEffect``, an ordered effect.
JAX's own lowering rules for ``cond``, ``switch``, ``while_loop``, ``scan``, nested ``jit``, custom
derivatives, ``checkpoint`` and ``shard_map`` then thread one token through all the taps of a
computation in program order, as they do for any ordered effect. What an ordered effect would
also do at the top of a computation is what costs: a runtime token passed in and out, which makes
JAX dispatch the computation through Python and chain it to the previous one (70 to 180 us a call
on a 2-core CPU). So just before JAX lowers a computation, its jaxpr is wrapped in one
``program_order_scope`` equation, which creates the token inside the computation and leaves the
effect out of the computation's own effects. The executable then has no effects, and JAX keeps it
on its C++ fast path.

The hook into JAX's lowering and the while-loop rule are installed through the JAX seam
(``hostcallback._jax.patches``). It never changes a computation without a tap.
"""

from __future__ import annotations

import weakref

from jax import lax

from hostcallback import _jax as jx
from hostcallback import config
from hostcallback._jax import patches
from hostcallback._records.registry import BARRIER_MARKER_ID
from hostcallback._trace import fence


class ProgramOrderEffect(jx.effects.Effect):
    """Taps that reach the host in program order within one computation, on each device."""

    __str__ = __repr__ = lambda self: "HostcallbackProgramOrder"


class OrderedTapEffect(jx.effects.Effect):
    """ordered=True taps: program order within a computation and across computations too."""

    __str__ = __repr__ = lambda self: "HostcallbackOrderedTap"


program_order_effect = ProgramOrderEffect()
ordered_tap_effect = OrderedTapEffect()
TAP_EFFECTS = (ProgramOrderEffect, OrderedTapEffect)
for _effect_type in TAP_EFFECTS:
    patches.register_ordered_effect(_effect_type)


# ---- the scope: where a computation's program-order token is created --------------------------

program_order_scope_p = jx.Primitive("hostcallback_program_order_scope")
program_order_scope_p.multiple_results = True


def _scope_abstract_eval(*avals, jaxpr: jx.ClosedJaxpr):
    # Program order stays inside: the scope makes its token (the inner jaxpr's fence takes part
    # in that chain even where the taps are all ordered=True ones).
    return jaxpr.out_avals, jaxpr.effects - {program_order_effect}


program_order_scope_p.def_effectful_abstract_eval(_scope_abstract_eval)


def _scope_lowering(ctx, *args, jaxpr: jx.ClosedJaxpr):
    tokens = dict(ctx.tokens_in.items())
    tokens[program_order_effect] = jx.hlo.create_token()
    outs, tokens_out = jx.lower_jaxpr(ctx, jaxpr, jx.mlir.TokenSet(tokens), *args)
    ctx.set_tokens_out(jx.mlir.TokenSet(
        {effect: token for effect, token in tokens_out.items()
         if effect is not program_order_effect}))
    return outs


jx.mlir.register_lowering(program_order_scope_p, _scope_lowering, cacheable=False)


_scoped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def scoped(closed_jaxpr: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
    """The same computation, with its program-order token made inside it (or closed_jaxpr itself
    when it holds no tap). The same jaxpr gives the same result, so JAX's lowering cache hits."""
    if not any(isinstance(effect, TAP_EFFECTS) for effect in closed_jaxpr.effects):
        return closed_jaxpr
    found = _scoped.get(closed_jaxpr)
    if found is None:
        if _only_barrier_markers(closed_jaxpr.jaxpr):
            # A barrier's marker computation: no fence, so that it never counts as a tapped
            # computation a later barrier waits for (fence.py), nor waits for other taps itself.
            found = (closed_jaxpr if jx.simplified_jaxpr_constants()
                     else _wrap_in_scope(closed_jaxpr, fenced=False))
        elif jx.simplified_jaxpr_constants():
            # JAX then counts the computation's hoisted constants from the jaxpr it was given
            # and again from the one it lowers, and a scope merges repeated ones: leave the
            # token to JAX (order kept, at the price of JAX's slower dispatch for tapped
            # computations), with the fence's begin and end at the top level.
            found = _between_begin_and_end(closed_jaxpr)
        else:
            found = _wrap_in_scope(closed_jaxpr)
        _scoped[closed_jaxpr] = found
    return found


def _only_barrier_markers(jaxpr) -> bool:
    """Whether every tap in jaxpr (at any depth) is a barrier's marker."""
    consumers = set()

    def collect(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if "consumer_id" in eqn.params:
                consumers.add(eqn.params["consumer_id"])
            for sub in jx.jaxprs_in_params(eqn.params):
                collect(getattr(sub, "jaxpr", sub))

    collect(jaxpr)
    return consumers == {BARRIER_MARKER_ID}


def _between_begin_and_end(closed_jaxpr: jx.ClosedJaxpr,
                           in_scope: bool = False) -> jx.ClosedJaxpr:
    """A copy (so that the cache's value does not keep its key alive) whose taps run between a
    fence's begin and end (fence.py), in the chains of the taps' effects (and of program order,
    which a scope creates, ``in_scope``)."""
    jaxpr = closed_jaxpr.jaxpr
    chained = frozenset({effect for effect in closed_jaxpr.effects
                         if isinstance(effect, TAP_EFFECTS)}
                        | ({program_order_effect} if in_scope else set()))
    eqns = fence.around(list(jaxpr.eqns), chained, lambda invars, outvars, primitive, params:
                        jx.new_jaxpr_eqn(invars, outvars, primitive, params, chained,
                                         jx.new_source_info()))
    return jx.ClosedJaxpr(jx.Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns,
                                   jaxpr.effects | chained, debug_info=jaxpr.debug_info),
                          closed_jaxpr.consts)


def _wrap_in_scope(closed_jaxpr: jx.ClosedJaxpr, fenced: bool = True) -> jx.ClosedJaxpr:
    inner = _between_begin_and_end(closed_jaxpr, in_scope=True) if fenced else closed_jaxpr
    outer_effects = closed_jaxpr.effects - {program_order_effect}
    invars = [jx.Var(v.aval) for v in closed_jaxpr.jaxpr.invars]
    outvars = [jx.Var(aval) for aval in closed_jaxpr.out_avals]
    eqn = jx.new_jaxpr_eqn(invars, outvars, program_order_scope_p, {"jaxpr": inner},
                           outer_effects, jx.new_source_info())
    jaxpr = jx.Jaxpr([], invars, outvars, [eqn], outer_effects,
                       debug_info=closed_jaxpr.jaxpr.debug_info)
    return jx.ClosedJaxpr(jaxpr, [])


# ---- a while loop whose batched predicate taps ------------------------------------------------


def _keeping_finished_lanes(jax_while_lowering):
    """JAX lowers a while loop whose predicate has an ordered effect by evaluating the predicate
    inside the body; with a batched predicate (vmap) it then runs the body on every lane until all
    are done, and lanes that had finished go on changing (jax 0.10.2: a vmapped count-down to 0
    returns -1). When the predicate holds a tap, this lowers such a loop the same way but keeps
    each finished lane's carry; every other loop is left to JAX."""

    def rule(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
        if not (cond_jaxpr.out_avals[0].shape
                and any(isinstance(effect, TAP_EFFECTS) for effect in cond_jaxpr.effects)):
            return jax_while_lowering(ctx, *args, cond_jaxpr=cond_jaxpr, body_jaxpr=body_jaxpr,
                                      cond_nconsts=cond_nconsts, body_nconsts=body_nconsts)

        def lanes_going_on(cond_consts, carry):
            return jx.eval_jaxpr(cond_jaxpr.jaxpr, cond_jaxpr.consts, *cond_consts, *carry)[0]

        def loop(*args):
            cond_consts, body_consts, carry = jx.split_list(args, [cond_nconsts, body_nconsts])

            def step(state):
                going_on, carry = state
                new = jx.eval_jaxpr(body_jaxpr.jaxpr, body_jaxpr.consts, *body_consts, *carry)
                carry = [lax.select(lax.broadcast_in_dim(going_on, x.shape, range(going_on.ndim)),
                                    n, x) for n, x in zip(new, carry)]
                return lanes_going_on(cond_consts, carry), carry

            _, carry = lax.while_loop(lambda state: lax.reduce_or(state[0], range(state[0].ndim)),
                                      step, (lanes_going_on(cond_consts, carry), list(carry)))
            return carry

        return jx.mlir.lower_fun(loop, multiple_results=True)(ctx, *args)

    return rule


patches.wrap_lowering(lax.while_p, _keeping_finished_lanes)

# ---- the one hook into JAX's lowering: each computation's jaxpr gets its scope -------------------

# Rewrites a computation's jaxpr goes through before its scope (served_callbacks.py adds one).
_rewrites: list = []


def rewrite_before_scope(rewrite) -> None:
    """Has ``rewrite(closed_jaxpr, platform) -> closed_jaxpr`` applied to every computation
    before it is scoped (once, however often this is called with it); ``platform`` is the one
    it is lowered for ("cpu", "cuda"), or None where JAX does not say."""
    if rewrite not in _rewrites:
        _rewrites.append(rewrite)


def _rewritten_and_scoped(closed_jaxpr: jx.ClosedJaxpr, platform: str | None) -> jx.ClosedJaxpr:
    while config.at_next_lowering:
        config.at_next_lowering.pop(0)()
    for rewrite in _rewrites:
        closed_jaxpr = rewrite(closed_jaxpr, platform)
    return scoped(closed_jaxpr)


patches.wrap_computation_lowering(_rewritten_and_scoped)
