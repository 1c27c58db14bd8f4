"""The one seam between hostcallback and JAX's internals.

Everything hostcallback needs from JAX beyond its documented API comes from here: nothing else in
the package imports ``jax._src``, names XLA's private callback targets, or changes JAX
(patches.py holds the changes). Public surfaces (``jax.extend``, ``jax.interpreters``,
``jax.ffi``) come first; each private name says in one line why nothing public serves. Version
differences are feature checks here, never version tests elsewhere.

Two modes: JAX's internals through private.py (the default), or the portable mode, on public
APIs alone (portable.py, beside the primitive), when ``HOSTCALLBACK_PORTABLE=1`` asks for it,
private.py cannot be imported, or the running jaxlib would refuse the core's FFI handlers
(``_native/ffi_api.py``: taps then go through JAX's own callbacks); it then says once what it
lacks. On a JAX newer than the newest tested it warns once. Of hostcallback it imports only
versions.py, config.py and the compiled core (none imports the rest), and it fails at import,
naming the supported versions, on a JAX older than the oldest one supported.
"""

from __future__ import annotations

import contextlib
import warnings

import jax

from hostcallback import config, versions

versions.refuse_unsupported(jax.__version__)
UNTESTED = versions.is_untested(jax.__version__)
if UNTESTED:
    warnings.warn(f"hostcallback has been tested with {versions.SUPPORTED_TEXT}, not with jax "
                  f"{jax.__version__}; please report what does not work", stacklevel=2)

# ---- public names -------------------------------------------------------------------------

from jax.core import ShapedArray  # noqa: E402
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive, Var  # noqa: E402
from jax.extend.mlir import ir  # noqa: E402
from jax.extend.mlir.dialects import stablehlo as hlo  # noqa: E402
from jax.interpreters import ad, batching, mlir  # noqa: E402  (rule tables for primitive authors)

# ---- the mode: JAX's internals through private.py, or public APIs alone ------------------------

# What the portable mode lacks, in one line (the "Compatibility" document says more).
PORTABLE_LACKS = ("transforms in tap functions (vmap taps once per batch element; no taps of "
                  "tangents or cotangents), program order inside a computation, ordered=True, "
                  "taps and calls in jit over a sharded mesh (use shard_map), partitioned=True, "
                  "replays=, PURE taps, vmap methods of calls other than sequential, the device "
                  "of callback-transport records, synchronous native calls (a call function "
                  "that runs JAX work while steps are dispatched back to back waits forever), "
                  "delivery=\"dispatch\", the native GPU tap (taps on a GPU take JAX's "
                  "callbacks), "
                  "waits (barrier_wait, exit) that cover computations dispatched from another "
                  "thread whose results nobody holds, "
                  "and, before JAX 0.12, taps inside jax.checkpoint or inside loops under grad")


PORTABLE_REQUESTED = config.env_bool("HOSTCALLBACK_PORTABLE", False)
PORTABLE_REASON: str | None = "HOSTCALLBACK_PORTABLE=1" if PORTABLE_REQUESTED else None
if PORTABLE_REASON is None:
    try:
        from hostcallback._jax.private import *  # noqa: E402, F403
    except (ImportError, AttributeError, TypeError, ValueError) as _error:
        PORTABLE_REASON = (f"jax {jax.__version__} lacks or changed a private piece hostcallback "
                           f"uses ({type(_error).__name__}: {_error})")
if PORTABLE_REASON is None:
    from hostcallback._native import ffi_api  # noqa: E402

    if ffi_api.MISMATCH:  # the native handlers cannot run here: JAX's own callbacks carry taps
        PORTABLE_REASON = ffi_api.MISMATCH
PORTABLE = PORTABLE_REASON is not None
if PORTABLE and not PORTABLE_REQUESTED:
    warnings.warn(f"hostcallback runs in its portable mode: {PORTABLE_REASON}. It lacks "
                  f"{PORTABLE_LACKS}.", stacklevel=2)


def moveaxis(x, source: int, destination: int):
    """jax.numpy's moveaxis, traceable inside a batching rule."""
    return jax.numpy.moveaxis(x, source, destination)


def is_tracing() -> bool:
    """Whether we are inside a transformation (jit, vmap, grad, ...) rather than on the host."""
    if not PORTABLE:
        return not trace_state_clean()  # noqa: F405
    return isinstance(jax.numpy.zeros(()), jax.core.Tracer)


@contextlib.contextmanager
def outside_user_mesh():
    """Sets the user's context mesh (jax.set_mesh, use_mesh) aside, so that computations of our
    own (barrier markers) may use meshes of their own; it is back afterwards."""
    try:
        unset = jax.set_mesh(None)
    except (TypeError, ValueError):  # a JAX whose set_mesh takes only a Mesh (before 0.10)
        unset = contextlib.nullcontext() if PORTABLE else without_context_mesh()  # noqa: F405
    with unset:
        yield
