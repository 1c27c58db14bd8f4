"""Lowering a function on every device of a jit that XLA partitions over several devices, each
device on its own whole copy of the operands: a shard_map region over all of them, with a mesh of
our own, which threads the effects' tokens. Whole-value taps and calls (sharded_lowering.py), the
order points around a shared call, and a computation's begin and fence (fence.py) are built so.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hostcallback import _jax as jx
from hostcallback._jax import mlir

AXIS = "_hostcallback_devices"  # the mesh axis of a region, over all the computation's devices


def on_every_device(ctx, tokens_in, fn, args, avals_in, avals_out):
    """fn(*args) -> a sequence of results, lowered on every device of the computation:
    (results, the tokens after it)."""
    devices = ctx.module_context.axis_context.device_assignment
    mesh_devices = np.empty(len(devices), dtype=object)
    mesh_devices[:] = list(devices)
    mesh = jax.sharding.Mesh(mesh_devices, (AXIS,))
    region_ctx = dataclasses.replace(ctx, avals_in=avals_in, avals_out=avals_out,
                                     tokens_in=tokens_in, tokens_out=None)
    whole = jax.sharding.PartitionSpec()
    # JAX refuses a shard_map whose mesh differs from the user's context mesh (jax.set_mesh,
    # use_mesh; JAX 0.8.0 checks when the shard_map is made, later ones when it is traced): the
    # region is made and built as if none were set; the user's is back once it is built.
    with jx.outside_abstract_mesh():
        region = jax.shard_map(lambda *xs: tuple(fn(*xs)), mesh=mesh,
                               in_specs=(whole,) * len(args), out_specs=(whole,) * len(avals_out),
                               check_vma=False)
        outs = mlir.lower_fun(region, multiple_results=True)(region_ctx, *args)
    return outs, region_ctx.tokens_out or tokens_in
