"""Keeps control flow that holds a tap from being removed as dead code.

Taps declare an effect (program_order.py), which JAX's dead-code elimination respects; this
module does not rely on that alone: each DCE rule of a primitive that holds sub-jaxprs (``cond``,
``scan``, ``while_loop``, nested ``jit``) is wrapped so that an equation containing a tap is kept
whole when none of its results are used, and otherwise left to JAX's rule (which keeps the tap
through the tap's own DCE rule), so that ``lax.cond(step % 100 == 0, lambda: id_print(loss),
lambda: None)`` always prints. A PURE tap declares no effect and is dropped with its unused
results, as JAX drops a pure callback. Nothing else about DCE changes.
"""

from __future__ import annotations

from hostcallback import _jax as jx
from hostcallback._jax import patches
from hostcallback.flavors import PURE_FLAVOR

_tap_primitives: set = set()


def register_tap_primitive(primitive) -> None:
    _tap_primitives.add(primitive)
    patches.keep_whole_when_unused(
        keep=lambda eqn: any(contains_tap(sub) for sub in jx.jaxprs_in_params(eqn.params)),
        skip=lambda p: p in _tap_primitives)


def contains_tap(jaxpr) -> bool:
    """Whether jaxpr holds a tap that must not be removed (a PURE one may be)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr holds a Jaxpr
    for eqn in jaxpr.eqns:
        if eqn.primitive in _tap_primitives and eqn.params.get("flavor") != PURE_FLAVOR:
            return True
        if any(contains_tap(sub) for sub in jx.jaxprs_in_params(eqn.params)):
            return True
    return False
