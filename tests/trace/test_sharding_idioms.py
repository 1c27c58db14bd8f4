"""Taps and calls in a sharded step, written each way JAX teaches sharded code, on both transports.

Every idiom runs the same four checks: a whole-value id_tap delivers the whole value once from
the device at device_index, id_print prints once, call returns the right values to every shard,
and partitioned=True delivers each device's own shard without gathering anything.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import run_python
from hostcallback._trace.transport import callback as callback_transport


class Idiom(NamedTuple):
    """How a user runs ``step`` on sharded data: returns the output and the devices, in the order
    the computation's device_index counts them."""

    name: str
    run: Callable


def _mesh(axis_type=AxisType.Auto, devices=None):
    devices = jax.devices() if devices is None else devices
    return Mesh(np.array(devices), ("d",), axis_types=(axis_type,))


VALUE = np.arange(16, dtype=np.float32)
VALUE_2D = np.arange(16, dtype=np.float32).reshape(4, 4)


def _plain_jit(step, context=contextlib.nullcontext, axis_type=AxisType.Auto):
    mesh = _mesh(axis_type)
    with context(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        return jax.jit(step)(x), list(mesh.devices.flat)


def _in_out_shardings(step):
    mesh = _mesh()
    f = jax.jit(step, in_shardings=NamedSharding(mesh, P("d")),
                out_shardings=NamedSharding(mesh, P("d")))
    return f(VALUE), list(mesh.devices.flat)


def _sharding_constraint(step):
    mesh = _mesh()
    with jax.set_mesh(mesh):
        f = jax.jit(lambda x: step(jax.lax.with_sharding_constraint(x, P("d"))))
        return f(jnp.asarray(VALUE)), list(mesh.devices.flat)


def _two_dimensional(step):
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        x = jax.device_put(VALUE_2D, NamedSharding(mesh, P("a", "b")))
        return jax.jit(step)(x), list(mesh.devices.flat)


def _subset_of_devices(step):
    mesh = _mesh(devices=jax.devices()[2:])
    with jax.set_mesh(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        return jax.jit(step)(x), list(mesh.devices.flat)


def _reversed_devices(step):
    mesh = _mesh(devices=jax.devices()[::-1])
    with jax.set_mesh(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        return jax.jit(step)(x), list(mesh.devices.flat)


def _nested_jit(step):
    mesh = _mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        return jax.jit(lambda x: jax.jit(step)(x) * 1)(x), list(mesh.devices.flat)


def _use_mesh(step):
    if not hasattr(jax.sharding, "use_mesh"):
        pytest.skip(f"jax {jax.__version__} has no jax.sharding.use_mesh")
    return _plain_jit(step, jax.sharding.use_mesh)  # pragma: no cover - newer JAX only


AUTOMATIC_IDIOMS = [
    Idiom("no mesh context", _plain_jit),
    Idiom("with mesh:", lambda step: _plain_jit(step, lambda mesh: mesh)),
    Idiom("jax.set_mesh, Auto axes", lambda step: _plain_jit(step, jax.set_mesh)),
    Idiom("jax.set_mesh, Explicit axes",
          lambda step: _plain_jit(step, jax.set_mesh, AxisType.Explicit)),
    Idiom("jax.sharding.use_mesh", _use_mesh),
    Idiom("jit in_shardings/out_shardings", _in_out_shardings),
    Idiom("with_sharding_constraint", _sharding_constraint),
    Idiom("2-D mesh", _two_dimensional),
    Idiom("mesh over 2 of 4 devices", _subset_of_devices),
    Idiom("mesh in reverse device order", _reversed_devices),
    Idiom("nested jit", _nested_jit),
]
IDS = [idiom.name for idiom in AUTOMATIC_IDIOMS]
BY_NAME = {idiom.name: idiom for idiom in AUTOMATIC_IDIOMS}
CALLBACK_DEVICE = "the device of callback-transport records"


def _value_for(idiom):
    return VALUE_2D if idiom.run is _two_dimensional else VALUE


@pytest.mark.needs_internals("taps in a jit over a sharded mesh", transport="native")
@pytest.mark.needs_internals(CALLBACK_DEVICE, transport="callback", device_index=1)
@pytest.mark.needs_internals(CALLBACK_DEVICE, transport="callback",
                             idiom=BY_NAME["mesh over 2 of 4 devices"])
@pytest.mark.needs_internals(CALLBACK_DEVICE, transport="callback",
                             idiom=BY_NAME["mesh in reverse device order"])
@pytest.mark.parametrize("idiom", AUTOMATIC_IDIOMS, ids=IDS)
@pytest.mark.parametrize("device_index", [0, 1])
def test_whole_value_tap_is_delivered_once_from_the_device_at_device_index(
        transport, collector, idiom, device_index):
    out, devices = idiom.run(lambda x: hcb.id_tap(collector, x * 2, tap_with_device=True,
                                                  device_index=device_index) + 1)
    hcb.barrier_wait()
    ((arg, transforms, device),) = collector.calls
    np.testing.assert_array_equal(arg, _value_for(idiom) * 2)
    assert transforms == ()
    assert device == devices[device_index]
    np.testing.assert_array_equal(out, _value_for(idiom) * 2 + 1)


@pytest.mark.needs_internals("taps and calls in a jit over a sharded mesh")
@pytest.mark.parametrize("reverse", [False, True], ids=["mesh in device order", "reversed mesh"])
@pytest.mark.parametrize("device_index", [0, 3])
def test_on_the_callback_transport_only_the_emitting_device_reaches_python(
        monkeypatch, collector, device_index, reverse):
    """As with JAX's own callbacks under a sharded jit, the other devices skip the host
    callback in XLA: each partition that reaches Python is counted, and the tap comes from the
    device at device_index."""
    reached = []
    mapper = callback_transport._device_of_partition

    def counting_mapper(axis_context):
        device_of = mapper(axis_context)
        return lambda partition: reached.append(int(partition)) or device_of(partition)

    monkeypatch.setattr(callback_transport, "_device_of_partition", counting_mapper)
    devices = jax.devices()[::-1] if reverse else jax.devices()
    mesh = _mesh(devices=devices)
    with hcb.config.override(transport="callback"), jax.set_mesh(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        jax.jit(lambda x: hcb.id_tap(collector, x, device_index=device_index,
                                     tap_with_device=True))(x)
        out = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) + 1, x, result_shape=x,
                                         device_index=device_index))(x)
    hcb.barrier_wait()
    assert reached == [device_index, device_index]
    ((_, _, device),) = collector.calls
    assert device == devices[device_index]
    np.testing.assert_array_equal(out, VALUE + 1)


@pytest.mark.needs_internals("taps in a jit over a sharded mesh", transport="native")
@pytest.mark.parametrize("idiom", AUTOMATIC_IDIOMS, ids=IDS)
def test_id_print_prints_the_whole_value_once(transport, idiom):
    stream = io.StringIO()
    idiom.run(lambda x: hcb.id_print(x.sum(), what="total", output_stream=stream, result=x))
    hcb.barrier_wait()
    header, value = stream.getvalue().splitlines()
    assert header == "what: total" and float(value) == _value_for(idiom).sum()


@pytest.mark.needs_internals("calls in a jit over a sharded mesh", transport="native")
@pytest.mark.parametrize("idiom", AUTOMATIC_IDIOMS, ids=IDS)
def test_call_returns_the_host_answer_to_every_shard(transport, idiom):
    def times_ten(x):
        return np.asarray(x) * 10

    out, _ = idiom.run(lambda x: hcb.call(times_ten, x + 1, result_shape=x) - 1)
    expected = (_value_for(idiom) + 1) * 10 - 1
    np.testing.assert_array_equal(out, expected)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(shard.data, expected[shard.index])


@pytest.mark.needs_internals("partitioned=True")
@pytest.mark.parametrize("idiom", AUTOMATIC_IDIOMS, ids=IDS)
def test_partitioned_tap_delivers_each_shard_from_its_own_device(transport, collector, idiom):
    out, devices = idiom.run(
        lambda x: hcb.id_tap(collector, x * 2, tap_with_device=True, partitioned=True) + 1)
    hcb.barrier_wait()
    whole = _value_for(idiom) * 2
    np.testing.assert_array_equal(out, whole + 1)
    holders = {shard.device for shard in out.addressable_shards}
    assert sorted(d.id for _, _, d in collector.calls) == sorted(d.id for d in holders)
    assert {d.id for d in holders} <= {d.id for d in devices}
    for arg, transforms, _device in collector.calls:
        ((name, info),) = transforms
        assert name == "shard" and info["global_shape"] == (whole.shape,)
        ((offset,),) = (info["offset"],)
        where = tuple(slice(o, o + n) for o, n in zip(offset, arg.shape))
        np.testing.assert_array_equal(arg, whole[where])


# (out_shardings fixes the result's sharding whatever the tap does: left out)
FREE_RESULT_IDIOMS = [idiom for idiom in AUTOMATIC_IDIOMS if idiom.run is not _in_out_shardings]


@pytest.mark.needs_internals("taps in a jit over a sharded mesh")
@pytest.mark.parametrize("idiom", FREE_RESULT_IDIOMS, ids=[i.name for i in FREE_RESULT_IDIOMS])
def test_a_whole_value_tap_leaves_the_sharding_of_what_follows_as_it_was(transport, collector,
                                                                          idiom):
    untapped, _ = idiom.run(lambda x: x * 2 + 1)
    out, _ = idiom.run(lambda x: hcb.id_tap(collector, x * 2) + 1)
    hcb.barrier_wait()
    assert out.sharding.is_equivalent_to(untapped.sharding, out.ndim), (
        f"{out.sharding} after the tap, {untapped.sharding} without it")
    assert len(collector.calls) == 1


@pytest.mark.needs_internals("partitioned=True")
def test_a_partitioned_tap_of_what_a_whole_value_tap_returned_gets_shards(transport, collector):
    mesh = _mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        jax.jit(lambda x: hcb.id_tap(collector, hcb.id_tap(collector, x * 2), partitioned=True)
                )(x)
    hcb.barrier_wait()
    shapes = sorted(np.shape(arg) for arg, *_ in collector.calls)
    assert shapes == [(4,)] * 4 + [(16,)], shapes


@pytest.mark.needs_internals("partitioned=True")
def test_partitioned_tap_gathers_nothing(transport, collector):
    mesh = _mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        step = jax.jit(lambda x: hcb.id_tap(collector, x * 2, partitioned=True) + 1)
        hlo = step.lower(x).compile().as_text()
        step(x)
    hcb.barrier_wait()
    assert "all-gather" not in hlo and "all-reduce" not in hlo
    assert len(collector.calls) == 4


@pytest.mark.needs_internals("partitioned=True", tap_kind="partitioned")
@pytest.mark.needs_internals(CALLBACK_DEVICE, transport="callback")
@pytest.mark.parametrize("tap_kind", ["whole", "partitioned"])
def test_shard_map_inside_jit_under_set_mesh_taps_each_shard(transport, collector, tap_kind):
    mesh = _mesh()
    with jax.set_mesh(mesh):
        tap = lambda x: hcb.id_tap(collector, x, tap_with_device=True,
                                   partitioned=tap_kind == "partitioned")
        answer = lambda x: hcb.call(lambda v: np.asarray(v) + 100, x, result_shape=x)
        step = jax.jit(jax.shard_map(lambda x: answer(tap(x * 2)), in_specs=P("d"),
                                     out_specs=P("d")))
        out = step(jax.device_put(VALUE, NamedSharding(mesh, P("d"))))
    hcb.barrier_wait()
    np.testing.assert_array_equal(out, VALUE * 2 + 100)
    got = {device.id: arg for arg, _, device in collector.calls}
    assert sorted(got) == [0, 1, 2, 3]
    for device_id, shard in got.items():
        np.testing.assert_array_equal(shard, VALUE[4 * device_id:4 * device_id + 4] * 2)


@pytest.mark.needs_internals(CALLBACK_DEVICE, transport="callback")
def test_pmap_taps_and_calls_per_device(transport, collector):
    step = jax.pmap(lambda x: hcb.call(lambda v: np.asarray(v) * 3, hcb.id_tap(
        collector, x, tap_with_device=True), result_shape=x))
    out = step(jnp.arange(4.0))
    hcb.barrier_wait()
    np.testing.assert_array_equal(out, np.arange(4.0) * 3)
    assert {device.id: float(arg) for arg, _, device in collector.calls} == {
        0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}


@pytest.mark.needs_internals("hostcallback's own message for a tap in a partly manual shard_map "
                             "(automatic partitioning; JAX's or XLA's error is given)")
def test_a_tap_in_a_partly_manual_shard_map_is_a_clear_error_at_trace_time(transport, collector):
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        step = jax.jit(jax.shard_map(lambda x: hcb.id_tap(collector, x), in_specs=P("a"),
                                     out_specs=P("a"), axis_names={"a"}))
        x = jax.device_put(VALUE, NamedSharding(mesh, P("a")))
        with pytest.raises(NotImplementedError, match="every mesh axis to be manual"):
            step.lower(x)
    assert collector.calls == []


@pytest.mark.timeout(120)
@pytest.mark.needs_internals("taps in a jit over a sharded mesh", transport="native")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("timeout", [None, 60.0], ids=["no timeout", "timeout"])
def test_barrier_wait_works_inside_set_mesh(transport, collector, axis_type, timeout):
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        x = jax.device_put(VALUE, NamedSharding(mesh, P("d")))
        jax.jit(lambda x: hcb.id_tap(collector, x * 2))(x)
        hcb.barrier_wait(timeout=timeout)  # its markers run outside the user's mesh
        assert len(collector.values) == 1
        np.testing.assert_array_equal(collector.values[0], VALUE * 2)


FAILING_SHARDED_CALL = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import hostcallback as hcb

mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
def bad(v):
    raise ValueError("boom")
try:
    jax.jit(lambda x: hcb.call(bad, x, result_shape=x) + 1)(x).block_until_ready()
    print("no error")
except Exception as error:
    print("failed:", "hostcallback call consumer bad failed: ValueError: boom" in str(error))
print("next:", jax.jit(lambda x: hcb.call(lambda v: v * 2, x, result_shape=x))(x).tolist())
"""


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
def test_a_failing_call_in_a_sharded_jit_fails_the_computation_clearly_not_the_process(transport):
    # The caller once failed alone while the other devices waited for its results: XLA aborted
    # the process after 40 s. Now every device fails together, with the reason.
    result = run_python(FAILING_SHARDED_CALL, env={"HOSTCALLBACK_TRANSPORT": transport},
                        timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-2:] == [
        "failed: True", "next: [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]"]


@pytest.mark.needs_internals("partitioned=True")
def test_a_partitioned_tap_of_a_value_that_does_not_split_evenly_says_what_to_do(transport):
    mesh = _mesh()
    sharding = NamedSharding(mesh, P("d"))
    step = jax.jit(lambda n: hcb.id_tap(lambda a, t: None, jax.lax.with_sharding_constraint(
        jnp.arange(6.0) + n, sharding), partitioned=True))
    with pytest.raises(Exception, match="needs shards of equal size.*Pad it"):
        step(0.0)


CALLS_WITHOUT_RESULTS = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import hostcallback as hcb

mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
seen = []
def record(v):
    seen.append(float(v.sum()))
def bad(v):
    raise ValueError("boom")
for result_shape in (None, ()):
    out = jax.jit(lambda x: (hcb.call(record, x, result_shape=result_shape), x * 2)[1])(x)
    print("ran:", out.tolist()[:2], seen)
    try:
        jax.jit(lambda x: (hcb.call(bad, x, result_shape=result_shape), x * 2)[1])(
            x).block_until_ready()
        print("no error")
    except Exception as error:
        print("failed:", "ValueError: boom" in str(error))
"""


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("calls in a jit over a sharded mesh", transport="native")
def test_a_call_without_results_in_a_sharded_jit_runs_once_and_fails_clearly(transport):
    result = run_python(CALLS_WITHOUT_RESULTS, env={"HOSTCALLBACK_TRANSPORT": transport},
                        timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-4:] == [
        "ran: [0.0, 2.0] [28.0]", "failed: True", "ran: [0.0, 2.0] [28.0, 28.0]", "failed: True"]
