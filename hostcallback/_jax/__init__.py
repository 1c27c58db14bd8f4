"""The one seam between hostcallback and JAX's internals.

Everything hostcallback needs from JAX beyond its documented API comes from here: nothing else in
the package imports ``jax._src``, names XLA's private callback targets, or changes JAX
(patches.py holds the changes). Public surfaces (``jax.extend``, ``jax.interpreters``,
``jax.ffi``) come first; each private name says in one line why nothing public serves. Version
differences are feature checks here, never version tests elsewhere.

It never imports the rest of hostcallback, and it fails at import, naming the supported versions,
on a JAX older than the oldest one supported.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import jax

OLDEST_SUPPORTED = (0, 8, 0)
NEWEST_TESTED = (0, 12)  # the newest minor release that .ci/compat runs
SUPPORTED_TEXT = "jax 0.8 to 0.12 (tested: 0.8.3, 0.9.2, 0.10.2, 0.11.2, 0.12.0.1)"


def version_tuple(text: str) -> tuple[int, ...]:
    """(0, 12, 0, 1) for "0.12.0.1"; a pre-release suffix ("0.13.0.dev20261101") is dropped."""
    parts = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


JAX_VERSION = version_tuple(jax.__version__)
if JAX_VERSION < OLDEST_SUPPORTED:
    raise ImportError(f"hostcallback supports {SUPPORTED_TEXT}; this is jax {jax.__version__}. "
                      "Upgrade JAX: pip install -U jax")
UNTESTED = JAX_VERSION[:2] > NEWEST_TESTED
if UNTESTED:
    warnings.warn(f"hostcallback has been tested with {SUPPORTED_TEXT}, not with jax "
                  f"{jax.__version__}; please report what does not work", stacklevel=2)

# ---- public names -------------------------------------------------------------------------

from jax.core import ShapedArray  # noqa: E402
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive, Var  # noqa: E402
from jax.extend.mlir import ir  # noqa: E402
from jax.extend.mlir.dialects import stablehlo as hlo  # noqa: E402
from jax.interpreters import ad, batching, mlir  # noqa: E402  (rule tables for primitive authors)

# ---- private names, each because nothing public does the job ----------------------------------

# Effects: an effect type of our own must join JAX's effect sets to be lowered, ordered, and
# allowed in control flow, custom derivatives and remat; only the private module has the sets.
from jax._src import effects  # noqa: E402
# A token type, a clean trace check, sub-jaxprs and jaxpr evaluation for our rules.
from jax._src import core as _core  # noqa: E402
# The axis contexts that tell a lowering rule whether it runs per device, partitioned or not.
from jax._src import sharding_impls as _sharding  # noqa: E402
# Running a primitive eagerly, and marking one that needs its devices while it lowers.
from jax._src import dispatch as _dispatch  # noqa: E402
# DCE and remat rule tables, and the remat policy's enum (public partial_eval lacks the enum).
from jax._src.interpreters import partial_eval as pe  # noqa: E402
# The computation-wide lowering entry we wrap (patches.py), and nothing else from there.
from jax._src.interpreters import pxla  # noqa: E402
from jax._src.interpreters import mlir as _mlir  # noqa: E402  (set_sharding, ir_consts)
# JAX's own host-callback lowering: the callback transport rides on it.
from jax._src import callback as _callback  # noqa: E402
from jax._src import config as _config  # noqa: E402  (the partitioner and constants flags)
from jax._src import mesh as _mesh  # noqa: E402  (setting the user's abstract mesh aside)
from jax._src import source_info_util, util  # noqa: E402  (building an equation; split_list)
from jax._src.lib import xla_client as _xla_client  # noqa: E402  (GSPMD's OpSharding)

abstract_token = _core.abstract_token
no_effects = _core.no_effects
trace_state_clean = _core.trace_state_clean
jaxprs_in_params = _core.jaxprs_in_params
eval_jaxpr = _core.eval_jaxpr
new_jaxpr_eqn = _core.new_jaxpr_eqn
apply_primitive = _dispatch.apply_primitive
SPMDAxisContext = _sharding.SPMDAxisContext
ShardingContext = _sharding.ShardingContext
SdyArrayList, SdyArray, SdyDim = _sharding.SdyArrayList, _sharding.SdyArray, _sharding.SdyDim
OpSharding = _xla_client.OpSharding
set_sharding = _mlir.set_sharding
ir_consts = _mlir.ir_consts
emit_python_callback = _callback.emit_python_callback
split_list = util.split_list
new_source_info = source_info_util.new_source_info

# XLA's targets for JAX's own host callbacks, which a per-shard tap calls by index.
PYTHON_CALLBACK_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                           "cuda": "xla_ffi_python_gpu_callback",
                           "rocm": "xla_ffi_python_gpu_callback"}


def moveaxis(x, source: int, destination: int):
    """jax.numpy's moveaxis, traceable inside a batching rule."""
    return jax.numpy.moveaxis(x, source, destination)


def shardy_enabled() -> bool:
    return bool(_config.use_shardy_partitioner.value)


def simplified_jaxpr_constants() -> bool:
    flag = getattr(_config, "use_simplified_jaxpr_constants", None)
    return bool(flag is not None and flag.value)


_SUBCOMP_TAKES_TRACEBACK = "outer_traceback" in inspect.signature(_mlir.jaxpr_subcomp).parameters


def lower_jaxpr(ctx, jaxpr: ClosedJaxpr, tokens, *args):
    """Lowers ``jaxpr`` inline inside the rule whose context is ``ctx``: (outs, tokens_out)."""
    consts = _mlir.ir_consts(jaxpr.consts, [v.aval for v in jaxpr.jaxpr.constvars])
    extra = {"outer_traceback": ctx.traceback} if _SUBCOMP_TAKES_TRACEBACK else {}
    return _mlir.jaxpr_subcomp(ctx.module_context, jaxpr.jaxpr, ctx.name_stack, tokens, consts,
                               *args, dim_var_values=ctx.dim_var_values,
                               const_lowering=ctx.const_lowering, **extra)


@contextlib.contextmanager
def outside_user_mesh(abstract_only: bool = False):
    """Sets the user's mesh (jax.set_mesh, use_mesh) aside, so that computations of our own
    (barrier markers, a tap's region) may use meshes of their own; it is back afterwards.
    ``abstract_only``: only the abstract mesh, as a lowering rule may change."""
    if abstract_only:
        with _mesh.use_abstract_mesh(_mesh.empty_abstract_mesh):
            yield
        return
    try:
        unset = jax.set_mesh(None)
    except (TypeError, ValueError):  # jax < 0.9 takes only a Mesh
        unset = None
    if unset is not None:
        with unset:
            yield
        return
    previous_abstract = _config.abstract_mesh_context_manager.swap_local(_mesh.empty_abstract_mesh)
    previous_concrete = _config.device_context.swap_local(None)
    try:
        yield
    finally:
        _config.abstract_mesh_context_manager.set_local(previous_abstract)
        _config.device_context.set_local(previous_concrete)


def lowering_for_export(ctx) -> bool:
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def add_host_callback(ctx, callback) -> int:
    """Registers ``callback`` with the computation being lowered; returns its index."""
    ctx.module_context.add_host_callback(callback)
    return len(ctx.module_context.host_callbacks) - 1
