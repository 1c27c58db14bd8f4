"""A call in a jit over several devices of this process, on the native transport: every device's
part meets in our handler with its own shard, not in XLA's collectives; the host sees the whole
value, every device gets the whole answer, and the call keeps its place among the taps. Where a
part never comes, the others fail with our error within the call's timeout, never with XLA's
end of the process (tests/host/test_call_running_jax.py has the back-to-back steps of EvoX)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import run_python
from hostcallback import config
from hostcallback._native import outfeed

pytestmark = pytest.mark.needs_internals("calls in a jit over a sharded mesh met in the handler")

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


@pytest.fixture(autouse=True)
def native():
    with config.override(transport="native"):
        yield
    assert outfeed.shared_calls_kept() == 0  # every part of every call came and left


def _bytes_sent() -> int:
    return sum(stats["bytes_enqueued"] for stats in hcb.queue_stats().values())


def _collectives_in(compiled) -> list[str]:
    text = compiled.as_text()
    return [name for name in COLLECTIVES if name in text]


@pytest.mark.parametrize("spec", [P("a", "b"), P(None, "b"), P("b", "a"), P("a", None), P()],
                         ids=str)
def test_the_host_gets_the_whole_value_and_the_program_no_collective(spec):
    mesh = jax.make_mesh((2, 2), ("a", "b"))
    value = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = jax.device_put(value, NamedSharding(mesh, spec))
    seen = []

    def host(v):
        seen.append(np.array(v))
        return np.asarray(v) * 2

    step = jax.jit(lambda x: hcb.call(host, x, result_shape=x) + 1)
    assert _collectives_in(step.lower(x).compile()) == []
    out = jax.block_until_ready(step(x))
    np.testing.assert_array_equal(seen, [value])
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(shard.data, (value * 2 + 1)[shard.index])


def test_several_operands_of_different_shardings_arrive_whole_at_the_calling_device():
    mesh = jax.make_mesh((4,), ("d",))
    a = jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P("d")))
    b = jax.device_put(np.float32(2.5), NamedSharding(mesh, P()))
    seen = []

    def host(args, device):
        seen.append((args["a"].tolist(), float(args["b"]), device))
        return args["a"] * 2

    step = jax.jit(lambda a, b: hcb.call(host, {"a": a, "b": b}, result_shape=a,
                                         call_with_device=True, device_index=3))
    out = jax.block_until_ready(step(a, b))
    assert seen == [(list(range(8)), 2.5, mesh.devices.flat[3])]
    np.testing.assert_array_equal(out, np.arange(8) * 2)


@pytest.mark.parametrize("spec", [P(), P("d")], ids=str)
def test_each_shard_is_sent_once_whoever_holds_it(spec):
    mesh = jax.make_mesh((4,), ("d",))
    value = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    x = jax.device_put(value, NamedSharding(mesh, spec))
    step = jax.jit(lambda x: hcb.call(lambda v: np.float32(v.sum()), x,
                                      result_shape=jax.ShapeDtypeStruct((), jnp.float32)))
    step(x).block_until_ready()  # compiled, and the receivers running
    before = _bytes_sent()
    assert float(step(x)) == value.sum()
    assert value.nbytes <= _bytes_sent() - before < 1.1 * value.nbytes


def test_a_value_xla_splits_unevenly_arrives_whole():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = []

    def step(n):  # 6 elements over 4 devices: padded shards, which XLA gathers first
        v = jax.lax.with_sharding_constraint(jnp.arange(6.0) + n, NamedSharding(mesh, P("d")))
        return hcb.call(lambda a: seen.append(a.tolist()) or np.asarray(a) * 2, v,
                        result_shape=v)

    np.testing.assert_array_equal(jax.jit(step)(1.0), (np.arange(6.0) + 1) * 2)
    assert seen == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]


def test_a_call_without_operands_answers_every_device():
    mesh = jax.make_mesh((4,), ("d",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
    calls = []
    seven = jax.ShapeDtypeStruct((2,), jnp.float32)
    step = jax.jit(lambda x: x.reshape(4, 2) + hcb.call(
        lambda _: calls.append(1) or np.full(2, 7, np.float32), (), result_shape=seven))
    assert _collectives_in(step.lower(x).compile()) == []
    np.testing.assert_array_equal(step(x), np.arange(8.0).reshape(4, 2) + 7)
    assert calls == [1]


def test_taps_before_and_after_a_call_keep_their_order(collector):
    mesh = jax.make_mesh((4,), ("d",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))

    def step(x):
        hcb.id_tap(collector, x.sum())  # before
        y = hcb.call(lambda v: (collector(np.float32(-1), ()), np.asarray(v) + 1)[1], x,
                     result_shape=x)
        hcb.id_tap(collector, x.sum() * 10)  # after, and independent of the call's answer
        return y

    compiled = jax.jit(step)
    for _ in range(10):
        compiled(x)
    hcb.barrier_wait()
    assert [float(v) for v in collector.values] == [28.0, -1.0, 280.0] * 10


def test_two_calls_of_one_function_in_a_step_meet_apart_each_with_its_own_answer():
    """Pure calls have no order among them: each call op meets by an id of its own (its site),
    so a device that runs them in another order than its neighbours cannot cross them."""
    mesh = jax.make_mesh((4,), ("d",))
    a = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
    b = jax.device_put(jnp.arange(8.0) * 100, NamedSharding(mesh, P("d")))

    def twice(v):
        return np.asarray(v) * 2

    step = jax.jit(lambda a, b: (hcb.pure_callback(twice, a, a), hcb.pure_callback(twice, b, b)))
    text = step.lower(a, b).compile().as_text()
    sites = re.findall(r"\bsite\s*=\s*(\d+)", text)
    assert len(sites) == 2 and len(set(sites)) == 2, sites
    for _ in range(20):
        out_a, out_b = jax.block_until_ready(step(a, b))
        np.testing.assert_array_equal(out_a, np.arange(8.0) * 2)
        np.testing.assert_array_equal(out_b, np.arange(8.0) * 200)


FAILING_CALL = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import hostcallback as hcb

mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
def refuse(v):
    raise ValueError("no answer today")
try:
    jax.jit(lambda x: hcb.call(refuse, x, result_shape=x))(x).block_until_ready()
except Exception as error:
    print("failed:", str(error).splitlines()[-1])
again = jax.jit(lambda x: hcb.call(lambda v: np.asarray(v) + 1, x, result_shape=x))(x)
print("next:", np.asarray(again).tolist())
"""


@pytest.mark.timeout(200)
def test_a_failing_call_fails_every_device_with_its_reason():
    # In a process of its own: JAX keeps a failed computation's runtime token and raises its
    # error again at every later jax.effects_barrier() of the process, exit included.
    result = run_python(FAILING_CALL, env={"HOSTCALLBACK_TRANSPORT": "native"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    failed, after = result.stdout.strip().splitlines()[-2:]
    assert "call consumer refuse failed: ValueError: no answer today" in failed
    assert after == "next: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]"


PARTS_MISSING = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import hostcallback as hcb
from hostcallback._native import outfeed

mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
def add_one(v):
    return np.asarray(v) + 1
hurried = jax.jit(lambda x: hcb.call(add_one, x, result_shape=x, timeout=1e-6))
outcomes = []
for _ in range(10):  # the first part waits a microsecond for the others
    try:
        outcomes.append(np.asarray(hurried(x)).tolist())
    except Exception as error:
        outcomes.append(str(error).splitlines()[-1])
patient = jax.jit(lambda x: hcb.call(add_one, x, result_shape=x))
after = np.asarray(patient(x)).tolist()
print(json.dumps({"outcomes": outcomes, "after": after, "kept": outfeed.shared_calls_kept()}))
"""


@pytest.mark.timeout(200)
def test_a_part_that_does_not_come_in_time_fails_every_part_saying_what_to_do():
    result = run_python(PARTS_MISSING, devices=4, timeout=150,
                        env={"HOSTCALLBACK_TRANSPORT": "native"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    missing = [o for o in report["outcomes"] if "reached this call within 1e-06 s" in o]
    assert missing, report["outcomes"]  # a microsecond is too short for 4 parts to meet
    assert "so the host was not called" in missing[0]
    assert "block_until_ready" in missing[0] and "(the call of add_one)" in missing[0]
    for outcome in report["outcomes"]:
        assert outcome in missing or outcome == [float(i + 1) for i in range(8)] or \
            "did not answer this call within its timeout of 1e-06 s" in outcome, outcome
    assert report["after"] == [float(i + 1) for i in range(8)]
    assert report["kept"] == 0  # the failed calls' parts all came, took the error and left


THREADS_BACK_TO_BACK = """
import json, threading
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import hostcallback as hcb

mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("d")))
def add_one(v):
    return np.asarray(v) + 1
step = jax.jit(lambda x: hcb.call(add_one, x, result_shape=x, timeout=3.0) - 1)
outcomes = {}
def steps(k):
    y = x + 1000 * k  # each thread its own values: an answer crossing over would show
    try:
        for i in range(100):
            y = step(y)  # dispatched back to back, from two threads at once
            if i % 15 == 14:  # both threads within XLA's 32 computations in flight per device
                jax.block_until_ready(y)
        outcomes[k] = float(np.asarray(y).sum())
    except Exception as error:
        outcomes[k] = str(error)
threads = [threading.Thread(target=steps, args=(k,)) for k in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(outcomes))
"""


@pytest.mark.timeout(200)
def test_two_threads_dispatching_sharded_steps_get_their_own_answers_or_our_error():
    """Two threads' shared calls never cross answers; where a part does not come within the
    call's timeout, every part of that call fails saying so, and XLA never ends the process (its
    limit here: 15 s). The threads block every 15 steps: with a device's 32 computations in
    flight, XLA's CPU client can deadlock by itself when two threads dispatch sharded steps
    (plain JAX does too: docs/observations-log.md, 2026-11-29)."""
    result = run_python(THREADS_BACK_TO_BACK, devices=4, timeout=150, env={
        "HOSTCALLBACK_TRANSPORT": "native",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                     "--xla_cpu_collective_call_terminate_timeout_seconds=15"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Termination timeout" not in result.stderr
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(outcomes) == ["0", "1"]
    for k, outcome in outcomes.items():
        if isinstance(outcome, float):
            assert outcome == float(sum(range(64)) + 64 * 1000 * int(k))
            continue
        assert ("of the 4 devices of a sharded computation reached this call within 3 s" in outcome
                or "did not answer this call within its timeout of 3 s" in outcome), outcome
        assert "block_until_ready" in outcome and "(the call of add_one)" in outcome
