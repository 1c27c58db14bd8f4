"""Four CPU devices (conftest forces them): pmap, shard_map and sharded jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb


def by_device(collector):
    return {device.id: np.asarray(arg) for arg, _, device in collector.calls}


def test_there_are_four_devices():
    assert jax.device_count() == 4


@pytest.mark.needs_internals("ordered=True", ordered=True)
@pytest.mark.needs_internals("the device of callback-transport records", transport="callback")
@pytest.mark.parametrize("ordered", [False, True])
def test_pmap_delivers_each_slice_from_its_own_device(transport, collector, ordered):
    f = jax.pmap(lambda x: hcb.id_tap(collector, x * 2, tap_with_device=True, ordered=ordered))
    f(jnp.arange(4.0))
    hcb.barrier_wait()
    assert by_device(collector) == {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0}


@pytest.mark.needs_internals("ordered=True", ordered=True)
@pytest.mark.needs_internals("the device of callback-transport records", transport="callback")
@pytest.mark.parametrize("ordered", [False, True])
def test_shard_map_delivers_each_shard_from_its_own_device(transport, collector, ordered):
    mesh = jax.make_mesh((4,), ("i",))
    tap = functools.partial(hcb.id_tap, collector, tap_with_device=True, ordered=ordered)
    f = jax.jit(jax.shard_map(lambda x: tap(x + 1), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    f(jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i"))))
    hcb.barrier_wait()
    got = by_device(collector)
    assert sorted(got) == [0, 1, 2, 3]
    for device_id, shard in got.items():
        np.testing.assert_array_equal(shard, [2 * device_id + 1, 2 * device_id + 2])


@pytest.mark.needs_internals("taps in a jit over a sharded mesh", transport="native")
@pytest.mark.needs_internals("the device of callback-transport records", transport="callback",
                             device_index=2)
@pytest.mark.parametrize("device_index", [0, 2])
def test_sharded_jit_taps_the_whole_value_once_on_device_index(transport, collector, device_index):
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    out = jax.jit(lambda x: hcb.id_tap(collector, x * 3, tap_with_device=True,
                                       device_index=device_index) + 1)(x)
    hcb.barrier_wait()
    ((arg, _, device),) = collector.calls
    np.testing.assert_array_equal(arg, np.arange(8.0) * 3)
    assert device == jax.devices()[device_index]
    np.testing.assert_array_equal(out, np.arange(8.0) * 3 + 1)


@pytest.mark.needs_internals("taps in a jit over a sharded mesh")
def test_sharded_jit_refuses_an_out_of_range_device_index(collector):
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    with pytest.raises(ValueError, match="device_index=4 is out of range"):
        jax.jit(lambda x: hcb.id_tap(collector, x, device_index=4))(x)


@pytest.mark.needs_internals("the device of callback-transport records", transport="callback")
def test_large_taps_on_four_devices_arrive_intact(transport, collector):
    value = np.arange(4 * 256 * 1024, dtype=np.float32).reshape(4, -1)  # 1 MiB per device
    jax.pmap(lambda x: hcb.id_tap(collector, x, tap_with_device=True))(value)
    hcb.barrier_wait()
    got = by_device(collector)
    for device_id in range(4):
        np.testing.assert_array_equal(got[device_id], value[device_id])


@pytest.mark.needs_internals("program order inside a computation")
def test_each_device_delivers_in_its_own_program_order(transport, collector):
    def f(x):
        for i in range(20):
            hcb.id_tap(collector, x + i, tap_with_device=True)
        return x

    jax.pmap(f)(jnp.arange(4) * 100)
    hcb.barrier_wait()
    for device_id in range(4):
        seen = [int(a) for a, _, d in collector.calls if d.id == device_id]
        assert seen == [100 * device_id + i for i in range(20)]


def _sharded(mesh, spec, value):
    return jax.device_put(value, NamedSharding(mesh, spec))


@pytest.mark.needs_internals("partitioned=True")
def test_partitioned_taps_give_each_device_its_own_shard_and_its_place(transport, collector):
    mesh = jax.make_mesh((2, 2), ("a", "b"))
    x = _sharded(mesh, P("a", "b"), jnp.arange(32.0).reshape(4, 8))
    f = jax.jit(lambda x: hcb.id_tap(collector, x * 2, tap_with_device=True, partitioned=True))
    np.testing.assert_array_equal(f(x), np.arange(32.0).reshape(4, 8) * 2)
    hcb.barrier_wait()
    assert len(collector.calls) == 4
    whole = np.zeros((4, 8))
    for shard, transforms, device in collector.calls:
        name, place = transforms[-1]
        assert name == "shard" and place["global_shape"] == ((4, 8),)
        (row, col), = place["offset"]
        assert shard.shape == (2, 4) and place["index"] == ((row // 2, col // 4),)
        np.testing.assert_array_equal(
            shard, x.addressable_data(list(mesh.devices.flat).index(device)) * 2)
        whole[row:row + 2, col:col + 4] = shard
    np.testing.assert_array_equal(whole, np.arange(32.0).reshape(4, 8) * 2)


@pytest.mark.needs_internals("partitioned=True")
def test_a_partitioned_tap_fires_even_when_its_result_is_unused(transport, collector):
    mesh = jax.make_mesh((4,), ("i",))

    def f(x):
        hcb.id_tap(collector, x + 1, partitioned=True)
        return x.sum()

    jax.jit(f)(_sharded(mesh, P("i"), jnp.arange(8.0)))
    hcb.barrier_wait()
    assert sorted(np.asarray(v).tolist() for v in collector.values) == [
        [1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]


@pytest.mark.needs_internals("partitioned=True")
def test_a_partitioned_tap_of_a_replicated_leaf_gives_each_device_the_whole_leaf(transport,
                                                                               collector):
    mesh = jax.make_mesh((4,), ("i",))
    x = _sharded(mesh, P("i"), jnp.arange(8.0))
    y = _sharded(mesh, P(), jnp.arange(3.0))
    jax.jit(lambda x, y: hcb.id_tap(collector, (x, y), partitioned=True))(x, y)
    hcb.barrier_wait()
    assert len(collector.calls) == 4
    for (x_shard, y_whole), transforms, _ in collector.calls:
        assert x_shard.shape == (2,)
        np.testing.assert_array_equal(y_whole, [0.0, 1.0, 2.0])
        assert transforms[-1][1]["offset"][1] == (0,)


@pytest.mark.needs_internals("partitioned=True")
def test_partitioned_is_a_no_op_where_each_device_already_taps_its_own_part(transport,
                                                                            collector):
    jax.pmap(lambda x: hcb.id_tap(collector, x, partitioned=True))(jnp.arange(4.0))
    hcb.barrier_wait()
    assert sorted(float(v) for v in collector.values) == [0.0, 1.0, 2.0, 3.0]
    assert all(transforms == () for _, transforms, _ in collector.calls)


def test_partitioned_and_ordered_together_are_a_clear_error(collector):
    with pytest.raises(ValueError, match="cannot also be ordered=True"):
        hcb.id_tap(collector, jnp.ones(2), partitioned=True, ordered=True)
