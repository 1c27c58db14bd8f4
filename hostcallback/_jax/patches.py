"""Every change hostcallback makes to JAX's own tables and functions, in one place.

Each function here installs one change and is safe to call again (a module reload); each
adapts to the JAX it runs on by a feature check. Nothing here runs at import: the modules that
need a change ask for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
from jax import lax

from hostcallback._jax.private import _dispatch, _mlir, compiler, effects, pe, pxla

_EFFECT_SETS = ("lowerable_effects", "control_flow_allowed_effects", "ordered_effects",
                "shardable_ordered_effects", "custom_derivatives_allowed_effects",
                "remat_allowed_effects")


def register_ordered_effect(effect_type: type) -> None:
    """Lets JAX lower an effect of ours, thread its token in program order, and allow it in
    control flow, custom derivatives and remat (JAX has no public way to say so)."""
    for name in _EFFECT_SETS:
        getattr(effects, name).add_type(effect_type)


def require_devices_during_lowering(primitive) -> None:
    """The primitive's lowering maps partitions to devices, so it needs the device assignment."""
    _dispatch.prim_requires_devices_during_lowering.add(primitive)


# JAX 0.12 calls DCE rules as rule(used_outputs, live_inputs, eqn); earlier ones as
# rule(used_outputs, eqn). Our rules are written in the short form and adapted here.
_DCE_TAKES_LIVE_INPUTS = len(inspect.signature(pe._default_dce_rule).parameters) == 3


def set_dce_rule(primitive, rule: Callable) -> None:
    """``rule(used_outputs, eqn) -> (used_inputs, eqn or None)`` for ``primitive``."""
    if _DCE_TAKES_LIVE_INPUTS:
        def adapted(used_outputs, live_inputs, eqn):
            return rule(used_outputs, eqn)
        pe.dce_rules[primitive] = adapted
    else:
        pe.dce_rules[primitive] = rule


_wrapped: set = set()


def keep_whole_when_unused(keep: Callable, skip: Callable) -> None:
    """Wraps every DCE rule (of primitives not ``skip``ped) so that an equation for which
    ``keep(eqn)`` holds is kept whole when none of its results are used; otherwise JAX's rule
    decides. A while loop, which has no rule of its own, gets JAX's default one wrapped."""
    pe.dce_rules.setdefault(lax.while_p, pe._default_dce_rule)
    for primitive, rule in list(pe.dce_rules.items()):
        if skip(primitive) or primitive in _wrapped:
            continue

        def dce_rule(used_outputs, *rest, _rule=rule):
            eqn = rest[-1]
            if not any(used_outputs) and keep(eqn):
                return [True] * len(eqn.invars), eqn
            return _rule(used_outputs, *rest)

        dce_rule.__wrapped__ = rule
        pe.dce_rules[primitive] = dce_rule
        _wrapped.add(primitive)


def set_remat_rule(primitive, rule: Callable) -> None:
    """How jax.checkpoint splits the primitive between the forward pass and recomputation."""
    pe.partial_eval_jaxpr_custom_rules[primitive] = rule


def is_recomputed(policy_answer) -> bool:
    """Whether a checkpoint policy's answer for an equation means 'recompute, do not save'."""
    return isinstance(pe.ensure_enum(policy_answer), pe.RecomputeType)


def wrap_lowering(primitive, make_rule: Callable[[Callable], Callable]) -> None:
    """Replaces JAX's lowering rule of ``primitive`` by ``make_rule(jax_rule)``; again on a
    reload, the rule wrapped is still JAX's own."""
    entry = _mlir._lowerings[primitive]
    jax_rule = getattr(entry.rule, "hostcallback_wraps", entry.rule)
    rule = make_rule(jax_rule)
    rule.hostcallback_wraps = jax_rule
    _mlir.register_lowering(primitive, rule, inline=entry.inline)


def wrap_computation_lowering(transform: Callable) -> None:
    """Hands every closed jaxpr that JAX lowers as a whole computation to
    ``transform(closed_jaxpr, platform)`` first (``platform``: the backend's, "cpu" say; None
    where the call does not say, or lowers for jax.export). Raises ImportError where JAX lowers
    computations through another entry point."""
    lower = getattr(pxla, "_cached_lowering_to_hlo", None)
    if lower is None:
        raise ImportError("jax lowers computations through an entry point hostcallback does not "
                          "know (no pxla._cached_lowering_to_hlo)")
    lower = getattr(lower, "hostcallback_wraps", lower)

    def lower_transformed(closed_jaxpr, *args, **kwargs):
        # (closed_jaxpr, module_name, backend, ...) in every JAX from 0.8 to 0.12.
        backend = args[1] if len(args) > 1 else kwargs.get("backend")
        platform = getattr(backend, "platform", None)
        if getattr(kwargs.get("lowering_parameters"), "for_export", False):
            platform = None
        return lower(transform(closed_jaxpr, platform), *args, **kwargs)

    lower_transformed.hostcallback_wraps = lower
    pxla._cached_lowering_to_hlo = lower_transformed


def add_to_effects_barrier(wait: Callable[[], None]) -> None:
    """Has ``jax.effects_barrier()`` call ``wait()`` after JAX's own wait (once, however often
    this is called)."""
    jax_barrier = getattr(jax.effects_barrier, "hostcallback_wraps", jax.effects_barrier)

    def effects_barrier() -> None:
        jax_barrier()
        wait()

    effects_barrier.hostcallback_wraps = jax_barrier
    effects_barrier.__doc__ = jax_barrier.__doc__
    jax.effects_barrier = effects_barrier


def compile_again_when(rescue: Callable[[Exception, str], list[tuple[str, str]] | None]) -> None:
    """Where XLA fails to compile a module, asks ``rescue(error, platform)`` for compiler options
    (XLA debug options, by name) under which to compile it once more; None: the error stands.
    The options apply to that module alone (once, however often this is called)."""
    compile_ = getattr(compiler, "backend_compile_and_load", None)
    if compile_ is None:
        return  # a JAX that compiles elsewhere: nothing to rescue
    compile_ = getattr(compile_, "hostcallback_wraps", compile_)
    parameters = list(inspect.signature(compile_).parameters)
    if parameters[:4] != ["backend", "module", "executable_devices", "options"]:
        return

    def backend_compile_and_load(backend, module, executable_devices, options, *args, **kwargs):
        try:
            return compile_(backend, module, executable_devices, options, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - XLA's own error type differs by version
            overrides = rescue(error, getattr(backend, "platform", ""))
            if not overrides:
                raise
            before = list(options.env_option_overrides)
            options.env_option_overrides = before + list(overrides)
            try:
                return compile_(backend, module, executable_devices, options, *args, **kwargs)
            finally:
                options.env_option_overrides = before

    backend_compile_and_load.hostcallback_wraps = compile_
    compiler.backend_compile_and_load = backend_compile_and_load
