"""JAX's private names that hostcallback uses, each because nothing public does the job.

Imported only through ``hostcallback._jax``, which falls back to the portable mode when this
module cannot be imported: a name gone or a function whose signature the feature checks do not
know raises ImportError here, never a failure later at trace time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

# JAX's own host-callback lowering: the callback transport rides on it.
from jax._src import callback as _callback

# Effects: an effect type of our own must join JAX's effect sets to be lowered, ordered, and
# allowed in control flow, custom derivatives and remat; only the private module has the sets.
# compiler: the one function that hands a lowered module to XLA (patches.py wraps it).
from jax._src import compiler, effects, source_info_util, util  # building an equation; split_list
from jax._src import config as _config  # the partitioner and constants flags, the context mesh

# A token type, a clean-trace check, sub-jaxprs and jaxpr evaluation for our rules.
from jax._src import core as _core

# Running a primitive eagerly, and marking one that needs its devices while it lowers.
from jax._src import dispatch as _dispatch
from jax._src import mesh as _mesh  # setting the user's abstract mesh aside

# The axis contexts that tell a lowering rule whether it runs per device, partitioned or not.
from jax._src import sharding_impls as _sharding

# set_sharding, ir_consts, jaxpr_subcomp and the lowering table: not in jax.interpreters.mlir.
from jax._src.interpreters import mlir as _mlir

# DCE and remat rule tables, and the remat policy's enum (public partial_eval lacks the enum).
from jax._src.interpreters import partial_eval as pe

# The computation-wide lowering entry we wrap (patches.py), and nothing else from there.
from jax._src.interpreters import pxla
from jax._src.lib import xla_client as _xla_client  # GSPMD's OpSharding
from jax.extend.mlir.dialects import sdy as _sdy

_PropagationBarrier = getattr(_sdy, "PropagationBarrierOp", None)  # not in every jaxlib

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
_SET_SHARDING_TAKES_CONTEXT = len(inspect.signature(_mlir.set_sharding).parameters) == 3


def set_sharding(module_context, op, sharding) -> None:
    """Annotates ``op`` with ``sharding`` (JAX before 0.10 takes no module context)."""
    if _SET_SHARDING_TAKES_CONTEXT:
        _mlir.set_sharding(module_context, op, sharding)
    else:
        _mlir.set_sharding(op, sharding)


ir_consts = _mlir.ir_consts
_CALLBACK_TAKES_RETURNS_TOKEN = "returns_token" in inspect.signature(
    _callback.emit_python_callback).parameters


def emit_python_callback(ctx, callback, token, operands, operand_avals, result_avals, *,
                         has_side_effect: bool, returns_token: bool, sharding=None):
    """JAX's host-callback lowering; before 0.8.1 it returns a token exactly when given one, which
    is what ``returns_token`` asks of later versions (we pass it True with a token only)."""
    extra = {"returns_token": returns_token} if _CALLBACK_TAKES_RETURNS_TOKEN else {}
    return _callback.emit_python_callback(ctx, callback, token, operands, operand_avals,
                                          result_avals, has_side_effect=has_side_effect,
                                          sharding=sharding, **extra)
split_list = util.split_list
new_source_info = source_info_util.new_source_info

# What patches.py changes, and what the rules look up only when they run, must exist at import:
# checked before anything is changed, so a JAX that lacks one falls back to the portable mode.
for _module, _name in ((pxla, "_cached_lowering_to_hlo"), (_mlir, "_lowerings"),
                       (pe, "dce_rules"), (pe, "partial_eval_jaxpr_custom_rules"),
                       (pe, "_default_dce_rule"), (pe, "ensure_enum"), (pe, "RecomputeType"),
                       (_dispatch, "prim_requires_devices_during_lowering"),
                       (effects, "ordered_effects"), (effects, "control_flow_allowed_effects"),
                       (effects, "shardable_ordered_effects"), (effects, "remat_allowed_effects"),
                       (effects, "custom_derivatives_allowed_effects"),
                       (_config, "use_shardy_partitioner"), (_mesh, "use_abstract_mesh"),
                       (_mesh, "empty_abstract_mesh"), (_mlir.ModuleContext, "add_host_callback"),
                       (_mlir, "lower_fun"), (_mlir, "TokenSet")):
    if not hasattr(_module, _name):
        raise ImportError(f"{getattr(_module, '__name__', _module)}.{_name} is not there")
if "const_lowering" not in {f.name for f in dataclasses.fields(_mlir.LoweringRuleContext)}:
    raise ImportError("mlir.LoweringRuleContext has no const_lowering")

# XLA's targets for JAX's own host callbacks, which a per-shard tap calls by index.
PYTHON_CALLBACK_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                           "cuda": "xla_ffi_python_gpu_callback",
                           "rocm": "xla_ffi_python_gpu_callback"}


def shardy_enabled() -> bool:
    return bool(_config.use_shardy_partitioner.value)


def propagating_forward_only(value):
    """``value``, through an op that lets Shardy carry its sharding on to its user but not back
    from it: a region that wants the whole value then gathers a copy and leaves the value's own
    sharding, and what else uses it, as they were. GSPMD (JAX's deprecated partitioner) has no
    such op: there the region's sharding still flows back."""
    if not shardy_enabled() or _PropagationBarrier is None:
        return value
    return _PropagationBarrier(value, _sdy.PropagationDirection.FORWARD).result


def manual_sharding(result_ranks: list[int]):
    """The annotation that says: run this op on every device, on its own data (shard_map).
    Shardy wants one entry per result, with one dimension entry per dimension."""
    if shardy_enabled():
        return SdyArrayList(tuple(
            SdyArray(mesh_shape=(), logical_device_ids=(),
                     dim_shardings=(SdyDim(axes=(), is_open=False),) * rank)
            for rank in result_ranks))
    op_sharding = OpSharding()
    op_sharding.type = OpSharding.Type.MANUAL
    return op_sharding


def simplified_jaxpr_constants() -> bool:
    flag = getattr(_config, "use_simplified_jaxpr_constants", None)
    return bool(flag is not None and flag.value)


_SUBCOMP_TAKES_TRACEBACK = "outer_traceback" in inspect.signature(_mlir.jaxpr_subcomp).parameters


def lower_jaxpr(ctx, jaxpr, tokens, *args):
    """Lowers ``jaxpr`` inline inside the rule whose context is ``ctx``: (outs, tokens_out)."""
    consts = _mlir.ir_consts(jaxpr.consts, [v.aval for v in jaxpr.jaxpr.constvars])
    extra = {"outer_traceback": ctx.traceback} if _SUBCOMP_TAKES_TRACEBACK else {}
    return _mlir.jaxpr_subcomp(ctx.module_context, jaxpr.jaxpr, ctx.name_stack, tokens, consts,
                               *args, dim_var_values=ctx.dim_var_values,
                               const_lowering=ctx.const_lowering, **extra)


@contextlib.contextmanager
def outside_abstract_mesh():
    """Inside a lowering rule: the user's abstract mesh set aside, so that a shard_map of ours
    over its own mesh is accepted; it is back afterwards."""
    with _mesh.use_abstract_mesh(_mesh.empty_abstract_mesh):
        yield


@contextlib.contextmanager
def without_context_mesh():
    """jax.set_mesh(None) for a JAX whose set_mesh takes only a Mesh (before 0.10). The context
    variables live in config there (in mesh from 0.11 on)."""
    abstract = getattr(_config, "abstract_mesh_context_manager", None) or \
        _mesh.abstract_mesh_context_manager
    concrete = getattr(_config, "device_context", None) or _mesh.device_context
    previous_abstract = abstract.swap_local(_mesh.empty_abstract_mesh)
    previous_concrete = concrete.swap_local(None)
    try:
        yield
    finally:
        abstract.set_local(previous_abstract)
        concrete.set_local(previous_concrete)


def lowering_for_export(ctx) -> bool:
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def add_host_callback(ctx, callback) -> int:
    """Registers ``callback`` with the computation being lowered; returns its index."""
    ctx.module_context.add_host_callback(callback)
    return len(ctx.module_context.host_callbacks) - 1


def _never_called(*args):
    raise AssertionError("hostcallback's placeholder host callback was called")


def run_synchronously(ctx) -> None:
    """The computation registers a host callback it never calls: jaxlib then runs it
    synchronously on CPU, as it runs computations with JAX's own callbacks."""
    add_host_callback(ctx, _never_called)


__all__ = [
    "OpSharding", "PYTHON_CALLBACK_TARGETS", "SPMDAxisContext", "SdyArray", "SdyArrayList",
    "SdyDim", "ShardingContext", "abstract_token", "add_host_callback", "apply_primitive",
    "compiler",
    "effects", "emit_python_callback", "eval_jaxpr", "ir_consts", "jaxprs_in_params",
    "lower_jaxpr", "lowering_for_export", "manual_sharding", "new_jaxpr_eqn", "new_source_info",
    "no_effects",
    "outside_abstract_mesh", "pe", "propagating_forward_only", "pxla", "run_synchronously",
    "set_sharding", "shardy_enabled",
    "simplified_jaxpr_constants", "split_list", "trace_state_clean", "without_context_mesh",
]
