"""JAX's own callbacks (``jax.debug.callback``, ``jax.debug.print``, ``io_callback``,
``pure_callback``) served on hostcallback's transport: those of ``hostcallback.debug`` always, all
of them while the switch is on (``config.settings.jax_callbacks``, serving.py).

JAX traces and transforms them with its own rules (batching, JVP, transpose, remat, DCE). Just
before a computation is lowered for a native platform, each of their equations that is to be
served, at any depth, is replaced by our ``outside_call``: a tap for a debug callback or print, a
call for an io or pure callback, whose consumer runs the callback as JAX's own lowering would
(callback_primitives.py: jax.Arrays, as JAX's; ``hostcallback.debug.print`` formats read-only
numpy views that print as they do), and JAX's callback effects by ours (an unordered one by
program order, an ordered one by ``ordered=True``) wherever they now stand for ours. The
computation then lowers as any tapped one: program order, results ready once its callbacks
ran, the per-device and sharded forms. A callback we cannot serve as JAX would (an io or pure
callback given a ``sharding``, a value our records do not carry (sub-byte integers, PRNG keys),
one in a shard_map that leaves some mesh axes automatic or in a batched while predicate) is left
to JAX (in its own order, apart from ours; with every ordered one of its computation, if it is
ordered), and so is a computation lowered on a receiver thread (it would wait for itself). The
rewritten jaxpr is cached per jaxpr, so JAX's lowering cache still hits.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
from jax import tree_util

from hostcallback import _jax as jx
from hostcallback import config
from hostcallback._host.printing import HostArray, Printer
from hostcallback._host.record_context import current_record
from hostcallback._jax import callback_primitives, patches
from hostcallback._native import outfeed
from hostcallback._records import wire
from hostcallback._records.registry import DEBUG_CALLBACK_API, Consumer, EqualByKey, registry
from hostcallback._trace import program_order, transport
from hostcallback._trace.primitive import outside_call_p, params_of
from hostcallback._trace.program_order import ordered_tap_effect, program_order_effect
from hostcallback.errors import UnsupportedDtypeError
from hostcallback.flavors import CallbackFlavor
from hostcallback.lifecycle import lifecycle
from hostcallback.tapping import OnHost

_BY_PRIMITIVE = {served.primitive: served for served in callback_primitives.SERVED}
_FLAVORS = {"debug": CallbackFlavor.DEBUG, "io": CallbackFlavor.IO_CALLBACK,
            "pure": CallbackFlavor.PURE}
_JAX_APIS = {"debug": DEBUG_CALLBACK_API, "io": "io_callback", "pure": "pure_callback"}


def served(closed_jaxpr: jx.ClosedJaxpr, platform: str | None) -> jx.ClosedJaxpr:
    """``closed_jaxpr`` with the callbacks to serve served by us where we are native
    (``platform``); else itself."""
    if platform not in transport.NATIVE_PLATFORMS or current_record() is not None:
        return closed_jaxpr  # (on a receiver thread, a tap would wait for itself)
    serve_all = config.settings.jax_callbacks
    cache = _served[serve_all]
    found = cache.get(closed_jaxpr)
    if found is None:
        found = closed_jaxpr
        wanted = _every_callback if serve_all else _from_hostcallback_debug
        candidates = [(eqn, jax_keeps_it) for eqn, jax_keeps_it in _equations(closed_jaxpr.jaxpr)
                      if eqn.primitive in _BY_PRIMITIVE and wanted(eqn)]
        to_serve = {id(eqn) for eqn, jax_keeps_it in candidates if _servable(eqn, jax_keeps_it)}
        if any(_is_ordered(eqn) and id(eqn) not in to_serve for eqn, _ in candidates):
            # An ordered callback stays JAX's: so do the others, to stay in order with it.
            to_serve -= {id(eqn) for eqn, _ in candidates if _is_ordered(eqn)}
        if to_serve:
            lifecycle.ensure_started()
            outfeed.watch_interrupts()
            found = closed_jaxpr.replace(jaxpr=_rewritten(closed_jaxpr.jaxpr,
                                                          lambda eqn: id(eqn) in to_serve))
        cache[closed_jaxpr] = found
    return found


def _every_callback(eqn) -> bool:
    return True


def _from_hostcallback_debug(eqn) -> bool:
    return isinstance(callback_primitives.user_callback(eqn.params), OnHost)


def _hostcallback_debug_print(eqn) -> bool:
    """``hostcallback.debug.print`` formats read-only views that print as jax.Arrays do: what
    it prints is the same, without making jax.Arrays first."""
    callback = callback_primitives.user_callback(eqn.params)
    return isinstance(callback, OnHost) and isinstance(callback.target, Printer)


# Per jaxpr, its served form, with the switch off and on (for the native platforms, the only
# ones served).
_served = {False: weakref.WeakKeyDictionary(), True: weakref.WeakKeyDictionary()}


def _equations(jaxpr, manual: frozenset = frozenset(), mesh_axes: frozenset = frozenset(),
               in_batched_predicate: bool = False):
    """Every equation at any depth, with whether JAX's own lowering is to keep it: in a
    shard_map that leaves some of its mesh's axes automatic (JAX gathers and calls back on one
    device there), or in the predicate of a while loop that vmap batched (JAX lowers it by
    evaluating the predicate again in the body, which its callbacks show)."""
    for eqn in jaxpr.eqns:
        inner_manual, inner_axes = manual, mesh_axes
        if "mesh" in eqn.params and ("manual_axes" in eqn.params
                                     or "newly_manual_axes" in eqn.params):  # a shard_map
            newly = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))
            inner_manual = manual | frozenset(newly)
            inner_axes = frozenset(eqn.params["mesh"].axis_names)
        yield eqn, in_batched_predicate or (bool(manual) and manual != mesh_axes)
        predicate = eqn.params.get("cond_jaxpr") if "body_jaxpr" in eqn.params else None
        for sub in _jaxprs_in(eqn.params.values()):  # as _rewritten_param finds them
            batched = sub is predicate and bool(predicate.out_avals[0].shape)
            yield from _equations(getattr(sub, "jaxpr", sub), inner_manual, inner_axes,
                                  in_batched_predicate or batched)


def _servable(eqn, jax_keeps_it: bool) -> bool:
    return (not jax_keeps_it and eqn.params.get("sharding") is None
            and all(_travels(v.aval) for v in (*eqn.invars, *eqn.outvars)))


def _travels(aval) -> bool:
    """Whether our records carry values of this type (not: PRNG keys, sub-byte integers)."""
    try:
        wire.dtype_code(aval.dtype)
    except (TypeError, UnsupportedDtypeError):
        return False
    return True


# ---- the rewrite ---------------------------------------------------------------------------


def _rewritten(jaxpr: jx.Jaxpr, chosen) -> jx.Jaxpr:
    eqns = [_rewritten_equation(eqn, chosen) for eqn in jaxpr.eqns]
    if all(new is old for new, old in zip(eqns, jaxpr.eqns)):
        return jaxpr
    return jaxpr.replace(eqns=eqns, effects=_effects_now(jaxpr.effects, eqns))


def _rewritten_equation(eqn, chosen):
    served_primitive = _BY_PRIMITIVE.get(eqn.primitive)
    if served_primitive is not None:
        return _as_outside_call(eqn, served_primitive) if chosen(eqn) else eqn
    params = {name: _rewritten_param(value, chosen) for name, value in eqn.params.items()}
    if all(params[name] is value for name, value in eqn.params.items()):
        return eqn
    return eqn.replace(params=params,
                       effects=_effects_now(eqn.effects, list(_jaxprs_in(params.values()))))


def _rewritten_param(value: Any, chosen) -> Any:
    if isinstance(value, jx.ClosedJaxpr):
        jaxpr = _rewritten(value.jaxpr, chosen)
        return value if jaxpr is value.jaxpr else value.replace(jaxpr=jaxpr)
    if isinstance(value, jx.Jaxpr):
        return _rewritten(value, chosen)
    if isinstance(value, (tuple, list)) and any(
            isinstance(v, (jx.ClosedJaxpr, jx.Jaxpr, tuple, list)) for v in value):
        values = [_rewritten_param(v, chosen) for v in value]
        if all(new is old for new, old in zip(values, value)):
            return value
        return type(value)(values)
    return value


def _jaxprs_in(values):
    for value in values:
        if isinstance(value, (jx.ClosedJaxpr, jx.Jaxpr)):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _jaxprs_in(value)


_CALLBACK_EFFECTS = (*callback_primitives.EFFECT_ORDERED, *program_order.TAP_EFFECTS)


def _effects_now(effects, parts) -> set:
    """An equation's or jaxpr's ``effects`` with JAX's callback effects and ours as the
    rewritten ``parts`` (its equations, or its sub-jaxprs) now hold them."""
    kept = {e for e in effects if not isinstance(e, _CALLBACK_EFFECTS)}
    return kept | {e for part in parts for e in part.effects if isinstance(e, _CALLBACK_EFFECTS)}


def _is_ordered(eqn) -> bool:
    return any(callback_primitives.EFFECT_ORDERED.get(type(e), False) for e in eqn.effects)


def _as_outside_call(eqn, served_primitive):
    """The equation as our tap (debug) or call (io, pure), in JAX's effect's order."""
    kind = served_primitive.kind
    params = dict(eqn.params)
    in_avals = [v.aval for v in eqn.invars]
    runner = _RunAsJax(served_primitive, params, in_avals,
                       views=_hostcallback_debug_print(eqn))
    is_call = kind != "debug"
    consumer = Consumer(
        func=runner, treedef=tree_util.tree_structure(tuple(range(len(in_avals)))),
        name=runner.name, jax_api=_JAX_APIS[kind], x64=bool(jax.config.jax_enable_x64),
        result_treedef=(tree_util.tree_structure(tuple(range(len(eqn.outvars))))
                        if is_call else None),
        result_avals=tuple((v.aval.shape, v.aval.dtype) for v in eqn.outvars) if is_call else (),
        # JAX fails the computation whose debug callback raised; so does our native fence,
        # where the computation has one (results ready once its taps were handled; served
        # callbacks run only where the fence is native).
        fails_computation=not is_call and config.settings.delivery != "async")
    ordered = _is_ordered(eqn)
    flavor = _FLAVORS[kind]
    effects = (jx.no_effects if flavor is CallbackFlavor.PURE
               else {ordered_tap_effect if ordered else program_order_effect})
    new_params = params_of(
        consumer_id=registry.register(consumer), transport=transport.default_transport(),
        ordered=ordered, result_avals=tuple(v.aval for v in eqn.outvars) if is_call else None,
        flavor=flavor.value, vmap_method=params.get("vmap_method") if is_call else None,
        partitioned=bool(params.get("partitioned", False)))
    # A tap returns its operands: outputs of its own that nothing reads.
    outvars = list(eqn.outvars) if is_call else [jx.Var(aval) for aval in in_avals]
    return eqn.replace(primitive=outside_call_p, params=new_params, outvars=outvars,
                       effects=effects)


def _stable(value: Any, nested: bool = False) -> Any:
    """A hashable stand-in for an equation's param that is equal across retraces: the closure
    JAX flattens a debug callback's arguments with (made anew on every trace) by its code and
    what it holds; a tuple by its items; anything else itself, or where unhashable (a list,
    which may change) its id, kept alive by the registry, which holds the consumer."""
    closure = None if nested else getattr(value, "__closure__", None)
    if closure:
        try:
            return (value.__code__, tuple(_stable(cell.cell_contents, True) for cell in closure))
        except ValueError:  # an empty cell
            return ("id", id(value))
    if isinstance(value, tuple):
        return tuple(_stable(v, True) for v in value)
    if isinstance(value, dict):  # a debug callback's static arguments, by their position
        return ("dict", tuple((k, _stable(v, True)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _printable(leaf):
    return leaf.view(HostArray)


class _RunAsJax(EqualByKey):
    """A consumer that runs one equation's callback as JAX's impl does (callback_primitives.py):
    taps get ``(leaves, transforms)``, calls ``leaves``; both return what the callback returns."""

    __slots__ = ("in_avals", "name", "params", "primitive", "run")

    def __init__(self, served_primitive, params: dict, in_avals: list, views: bool) -> None:
        self.primitive, self.params = served_primitive.primitive, params
        self.in_avals = tuple(in_avals)
        views = views or served_primitive.prints
        self.run = served_primitive.prepare(params, self.in_avals, _printable if views else None)
        default = "jax.debug.print" if "fmt" in params else self.primitive.name
        self.name = callback_primitives.callback_name(params, default)

    def _key(self):
        # Equal for the same callback retraced, so that retracing reuses the consumer's id.
        return (self.primitive, self.in_avals,
                tuple(sorted((name, _stable(value)) for name, value in self.params.items())))

    def __call__(self, leaves, transforms=None):
        return self.run(leaves)


# JAX decides whether a computation's lowering knows its devices before we rewrite it; ours
# need them, where JAX's own lowering of a debug callback does not. (So, once this module is
# imported, a function with jax.debug callbacks lowers for devices, as one with io_callback
# always does: not with an abstract mesh alone.)
for _served_primitive in callback_primitives.SERVED:
    patches.require_devices_during_lowering(_served_primitive.primitive)
program_order.rewrite_before_scope(served)
