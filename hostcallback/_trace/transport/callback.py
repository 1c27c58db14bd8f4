"""The callback transport: the same tap contract on JAX's own host-callback machinery.

For platforms where our native handler is not registered (GPU and TPU today), or when
``HOSTCALLBACK_TRANSPORT=callback``. JAX hands the callback numpy arrays on the device's thread;
we copy them into the same outfeed queue the native handler writes (or hand large ones over:
hostcallback/_records/handover.py), so the same receivers deliver them. The callback never builds a
jax.Array (that path hangs with several CPU devices and large arguments, jax#25861) and never
calls the consumer itself.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import jax
import numpy as np

from hostcallback import _jax as jx
from hostcallback._jax import hlo, ir, mlir
from hostcallback._native import outfeed
from hostcallback._records import handover
from hostcallback.errors import describe_error

_PARTITION_AVAL = jx.ShapedArray((), np.uint32)
_CONSUMER_AVAL = jx.ShapedArray((), np.uint64)


def _device_of_partition(axis_context) -> Callable[[np.ndarray], jax.Device]:
    """Maps XLA's partition id, as the callback receives it, to the calling device. Its queue
    is named by platform and id, as the receivers name it."""
    if isinstance(axis_context, jx.SPMDAxisContext):
        devices = tuple(axis_context.mesh.devices.flat)
    else:
        devices = tuple(getattr(axis_context, "device_assignment", None) or ())
    if not devices:
        return lambda partition: jax.local_devices()[0]
    return lambda partition: devices[int(partition)]


def lower_tap(ctx, args, *, consumer_id: int, emit_device: int, device_index: int, token,
        op_sharding):
    device_of = _device_of_partition(ctx.module_context.axis_context)

    def enqueue_on_host(partition, *arrays):  # on the emitting device(s) only
        device = device_of(partition)
        try:
            handover.enqueue_tap(device.id, consumer_id, arrays, device.platform)
        except BaseException:
            outfeed.computation_failed()  # XLA runs nothing more of it, fence included
            raise
        return ()

    def emit():
        partition = hlo.partition_id()
        callback_ctx = dataclasses.replace(ctx, avals_in=[_PARTITION_AVAL, *ctx.avals_in],
                                           avals_out=[])
        _, token_out, _ = jx.emit_python_callback(
            callback_ctx, enqueue_on_host, token, [partition, *args], callback_ctx.avals_in, [],
            has_side_effect=True, returns_token=True, sharding=op_sharding)
        return [token_out]

    (token_out,) = _on_emitting_partition(ctx, emit_device, device_index, [], emit,
                                          lambda: [token])
    return token_out


def lower_call(ctx, args, *, consumer_id: int, emit_device: int, device_index: int, token,
         op_sharding, result_avals, timeout_s: float):
    """The device's Python callback sends the record and waits (GIL released) for the answer.
    A call shared over the devices of a sharded computation (emit_device != ALL_DEVICES): the other
    devices return zeros in XLA (_on_emitting_partition), and the last result is the failure
    flag, as in the native handler: the calling device returns zeros and the flag instead of
    failing on its own."""
    device_of = _device_of_partition(ctx.module_context.axis_context)
    shapes = [(a.shape, np.dtype(a.dtype)) for a in result_avals]
    shared = emit_device != outfeed.ALL_DEVICES

    def zeros():
        return tuple(np.zeros(shape, dtype) for shape, dtype in shapes)

    def call_on_host(partition, *arrays):  # on the calling device(s) only
        device = device_of(partition)
        try:
            answers = handover.call_and_wait(device.id, consumer_id, arrays, timeout_s,
                                    platform=device.platform)
            results = tuple(np.frombuffer(answer, dtype=dtype).reshape(shape)
                            for answer, (shape, dtype) in zip(answers, shapes))
        except BaseException as error:  # shared: every error becomes the flag, see above
            if not shared:
                outfeed.computation_failed()  # XLA runs nothing more of it, fence included
                raise
            reason = str(error) if isinstance(error, RuntimeError) else describe_error(error)
            if reason.startswith(outfeed.CALL_TIMEOUT_PREFIX):
                _report_shared_timeout(reason)
            return zeros()[:-1] + (np.uint32(outfeed.keep_call_failure(consumer_id, reason)),)
        return results + (np.uint32(0),) if shared else results

    op_sharding = _with_results(op_sharding, result_avals)

    def emit():
        partition = hlo.partition_id()
        callback_ctx = dataclasses.replace(ctx, avals_in=[_PARTITION_AVAL, *ctx.avals_in],
                                           avals_out=list(result_avals))
        results, token_out, _ = jx.emit_python_callback(
            callback_ctx, call_on_host, token, [partition, *args], callback_ctx.avals_in,
            list(result_avals), has_side_effect=True, returns_token=True, sharding=op_sharding)
        return [token_out, *results]

    def not_calling():  # zeros and a clear failure flag, as call_on_host returns there
        return [token, *(_zeros(aval) for aval in result_avals)]

    token_out, *results = _on_emitting_partition(ctx, emit_device, device_index,
                                                  list(result_avals), emit, not_calling)
    return token_out, results


def lower_fence(ctx, token, *, op_sharding):
    """A computation's fence where ours has no native handler (TPU, ROCm, with
    HOSTCALLBACK_CALLBACK_FENCE=1; fence.py): the device's Python callback waits (GIL released)
    until the device's receiver has handled every tap enqueued so far, as the native fence does,
    and answers; the device waits for the answer, and so the computation's results wait for its
    taps. A failed queue, a fork or an interruption fails the computation with its words; a
    stopped receiver, or a consumer stuck past the fence's patience, lets it go on, as the
    native fence does. A debug callback that raised does not fail it (no begin tells which
    computation made the tap); the next barrier raises it."""
    device_of = _device_of_partition(ctx.module_context.axis_context)

    def await_taps(partition):
        device = device_of(partition)
        failure = outfeed.await_taps(device.id, platform=device.platform)
        if failure:
            raise RuntimeError(failure)
        return (np.uint32(0),)

    callback_ctx = dataclasses.replace(ctx, avals_in=[_PARTITION_AVAL],
                                       avals_out=[_PARTITION_AVAL])
    _, token_out, _ = jx.emit_python_callback(
        callback_ctx, await_taps, token, [hlo.partition_id()], [_PARTITION_AVAL],
        [_PARTITION_AVAL], has_side_effect=True, returns_token=True,
        sharding=_with_results(op_sharding, [_PARTITION_AVAL]))
    return token_out


def _with_results(op_sharding, result_avals: list):
    """A callback's sharding (token first) as emit_python_callback takes it: with results, JAX
    adds the token's annotation itself."""
    if isinstance(op_sharding, jx.SdyArrayList) and result_avals:
        return jx.SdyArrayList(op_sharding.shardings[1:])
    return op_sharding


def _ir_type(aval) -> ir.Type:
    return ir.RankedTensorType.get(aval.shape, mlir.dtype_to_ir_type(np.dtype(aval.dtype)))


def _int32(value):
    return hlo.convert(ir.RankedTensorType.get([], ir.IntegerType.get_signless(32)), value)


def _case(index, types: list, branches: tuple) -> list:
    """The values of branches[index](), each branch a function that builds its values in MLIR;
    an index past the last branch runs the last one (stablehlo.case)."""
    case_op = hlo.CaseOp(types, index=index, num_branches=len(branches))
    for region, branch in zip(case_op.regions, branches):
        with ir.InsertionPoint(region.blocks.append()):
            hlo.return_(branch())
    return list(case_op.results)


def _zeros(aval):
    zero = mlir.ir_constant(np.zeros((), aval.dtype))
    return hlo.broadcast_in_dim(_ir_type(aval), zero, [])


def _on_emitting_partition(ctx, emit_device: int, device_index: int, result_avals: list,
                           emit: Callable[[], list], otherwise: Callable[[], list]) -> list:
    """[token, *results]: emit()'s on the device that emits, otherwise()'s on the others.

    Where every device of a shard_map region runs this op but one device emits (a whole-value tap
    or call under a sharded jit), only that device's Python callback runs, as only one of JAX's
    own runs there: the others take the other branch of a conditional on the partition id (the
    device's place in the region's mesh, which is device_index for the emitting one) and never
    reach Python. Every process builds the same program, the emitting one's or not.
    """
    axis_context = ctx.module_context.axis_context
    if emit_device == outfeed.ALL_DEVICES or not isinstance(axis_context, jx.SPMDAxisContext):
        return emit()
    emits = hlo.compare(hlo.partition_id(), mlir.ir_constant(np.uint32(device_index)),
                        hlo.ComparisonDirectionAttr.get("EQ"),
                        compare_type=hlo.ComparisonTypeAttr.get("UNSIGNED"))
    index = _int32(emits)
    types = [mlir.token_type(), *(_ir_type(a) for a in result_avals)]
    return _case(index, types, (otherwise, emit))  # index 1: the emitting device


def _report_shared_timeout(reason: str) -> None:
    """Says a shared call's timeout on stderr at once, as the native handler does: its devices
    fail together only after the collective that follows, and where XLA's CPU client left a
    device out of a collective, XLA ends the process (after 40 s) before the error reaches
    Python."""
    print(f"{reason} (a call shared over the devices of a sharded computation; every device "
          "fails with this error)", file=sys.stderr, flush=True)


def lower_check(ctx, failed, values, *, consumer_id: int, op_sharding):
    """After a shared call's results and failure flags were summed over the devices: every
    device fails with the call's reason when any failed, else passes the flag and the values
    through."""
    def check_on_host(failed, *values):
        if failed:
            outfeed.computation_failed()  # XLA runs nothing more of it, fence included
            raise RuntimeError(outfeed.call_failure_reason(consumer_id, int(failed)))
        return (failed, *values)

    avals = list(ctx.avals_in)

    def fail():
        callback_ctx = dataclasses.replace(ctx, avals_out=avals)
        results, _, _ = jx.emit_python_callback(
            callback_ctx, check_on_host, None, [failed, *values], avals, avals,
            has_side_effect=True, returns_token=False, sharding=op_sharding)
        return list(results)

    # Python runs only where the call failed (a flag of 1 or more: an index past the last branch
    # runs the last one); a step that passes stays in XLA.
    return _case(_int32(failed), [_ir_type(a) for a in avals],
                 (lambda: [failed, *values], fail))


def shard_callback(ctx) -> int:
    """For a partitioned tap under automatic sharding: registers, with the whole computation, the
    host callback each device's shard calls, and returns its index.

    XLA builds the per-shard computation later, as a separate module whose own host callbacks are
    thrown away; it calls this one by index instead (lower_tap_shard), with the consumer id and its
    partition id as operands.
    """
    if ctx.module_context.platforms[0] not in jx.PYTHON_CALLBACK_TARGETS:
        raise NotImplementedError(
            f"partitioned=True taps on {ctx.module_context.platforms[0]} are not supported (JAX's "
            "host callbacks cannot run per shard there); tap inside a shard_map instead, where "
            "each device taps its own shard")
    device_of = _device_of_partition(ctx.module_context.axis_context)

    def enqueue_shard(token, consumer_id, partition, *arrays):
        device = device_of(partition)
        handover.enqueue_tap(device.id, int(consumer_id), arrays, device.platform)
        return (token,)

    return jx.add_host_callback(ctx, enqueue_shard)


def lower_tap_shard(ctx, args, *, consumer_id: int, callback_index: int, token, op_sharding):
    """One device's shard of a partitioned tap: calls the callback shard_callback registered with
    the whole computation, with this device's partition id."""
    target = jx.PYTHON_CALLBACK_TARGETS[ctx.module_context.platforms[0]]
    operands = [token, mlir.ir_constant(np.uint64(consumer_id)), hlo.partition_id(), *args]
    call_ctx = dataclasses.replace(
        ctx, avals_in=[jx.abstract_token, _CONSUMER_AVAL, _PARTITION_AVAL, *ctx.avals_in],
        avals_out=[jx.abstract_token])
    (token_out,) = jax.ffi.ffi_lowering(target, has_side_effect=True)(
        call_ctx, *operands, index=np.uint64(callback_index))
    if op_sharding is not None:
        jx.set_sharding(ctx.module_context, token_out.owner, op_sharding)
    return token_out
