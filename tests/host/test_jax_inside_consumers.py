"""JAX run from inside a call function or a tap consumer, on the device that waits for it.

Each case runs in a fresh interpreter with a timeout, so a deadlock fails one test. Settled here:
small jitted computations work with a call pending and with a full 4 KiB queue, on one device,
under pmap and in a sharded jit; a tap or call traced there fails at once with what to do (it
would wait for the very thread that runs it); a computation XLA does not run inline, started
while a computation over several devices waits, hangs (documented in docs/architecture.md).
"""

import json
import re
import subprocess

import pytest

from helpers import ROOT, TRANSPORTS, run_python

PRELUDE = """
import json, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import hostcallback as hcb

triple = jax.jit(lambda v: v * 3)

def on_device(v, device):
    return np.asarray(triple(jax.device_put(np.asarray(v), device)))

def run(body, scenario, n=4):
    x = jnp.arange(n * 16, dtype=jnp.float32)
    if scenario == "one_device":
        return np.asarray(jax.jit(body)(x[:16]))
    if scenario == "pmap":
        return np.asarray(jax.pmap(body)(x.reshape(n, 16)))
    mesh = jax.make_mesh((n,), ("i",))
    return np.asarray(jax.jit(body)(jax.device_put(x, NamedSharding(mesh, P("i")))))
"""

SMALL_JAX = PRELUDE + """
scenario = {scenario!r}
called = run(lambda x: hcb.call(on_device, x, result_shape=x, call_with_device=True), scenario)

hcb.configure(max_queue_bytes=4096)
seen = []
def consume(v, transforms, device):
    if not seen:  # hold the first record until the device waits for room (at most 30 s)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                s["producers_waiting"] for s in hcb.queue_stats().values()):
            time.sleep(0.01)
    seen.append(float(on_device(v, device).sum()))

def taps(x):
    def step(i, c):
        hcb.id_tap(consume, c + i.astype(c.dtype), tap_with_device=True)
        return c
    return jax.lax.fori_loop(0, 100, step, x)  # 100 records of 64 bytes and more: > 4 KiB

tapped = run(taps, scenario)
hcb.barrier_wait()
waits = sum(s["waits"] for s in hcb.queue_stats().values())
expected_called = float(3 * run(lambda x: x, scenario).sum())
print(json.dumps({{"called": float(called.sum()), "expected_called": expected_called,
                  "seen": len(seen), "seen_sum": sum(seen), "waits": waits}}))
"""


def _last_json(process) -> dict:
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("calls in a jit over a sharded mesh", scenario="sharded_jit",
                             transport="native")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scenario,devices", [("one_device", 1), ("pmap", 4), ("sharded_jit", 4)])
def test_small_jax_on_the_waiting_device_completes_with_a_call_pending_and_a_full_queue(
        transport, scenario, devices):
    process = run_python(SMALL_JAX.format(scenario=scenario), devices=devices, timeout=90,
                         env={"HOSTCALLBACK_TRANSPORT": transport})
    result = _last_json(process)
    assert result["called"] == result["expected_called"]
    assert result["seen"] == 100 * (devices if scenario == "pmap" else 1)
    values = 16 if scenario == "one_device" else 64  # tapped over all taps, all devices
    # Tap i sees x + i, tripled on the device: 3 * (sum(x) + len(x) * i) summed over i < 100.
    assert result["seen_sum"] == 3 * (100 * sum(range(values)) + values * sum(range(100)))
    assert result["waits"] > 0  # the queue was full: the device waited for the consumer


NESTED_CALL = PRELUDE + """
scenario = {scenario!r}
def host(v):
    inner = jax.jit(lambda w: hcb.call(lambda a: np.asarray(a) * 2, w, result_shape=w))
    return np.asarray(inner(np.asarray(v)))

try:
    run(lambda x: hcb.call(host, x, result_shape=x), scenario)
    print(json.dumps({{"outcome": "no error"}}))
except Exception as error:
    message = str(error)
    try:
        hcb.barrier_wait()
    except hcb.CallbackException:
        pass
    after = run(lambda x: hcb.call(lambda v: np.asarray(v) + 1, x, result_shape=x), scenario)
    print(json.dumps({{"outcome": message, "after": float(after.sum())}}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scenario,devices", [("one_device", 1), ("pmap", 4)])
def test_a_call_traced_inside_a_call_function_fails_at_once_saying_what_to_do(
        transport, scenario, devices):
    process = run_python(NESTED_CALL.format(scenario=scenario), devices=devices, timeout=60,
                         env={"HOSTCALLBACK_TRANSPORT": transport})
    result = _last_json(process)
    assert "a call was traced inside a tap consumer or call function" in result["outcome"]
    assert "numpy" in result["outcome"] and "queue.Queue" in result["outcome"]
    values = 16 if scenario == "one_device" else 4 * 16
    assert result["after"] == sum(range(values)) + values  # the receivers keep working


NESTED_TAP = PRELUDE + """
hcb.configure(max_queue_bytes=4096)
def consume(v, transforms):
    jax.jit(lambda w: hcb.id_tap(lambda *a: None, w * 3))(np.asarray(v))

def taps(x):
    def step(i, c):
        hcb.id_tap(consume, c + i.astype(c.dtype))
        return c
    return jax.lax.fori_loop(0, 100, step, x)

run(taps, "one_device").sum()
try:
    hcb.barrier_wait()
    print(json.dumps({{"outcome": "no error"}}))
except hcb.CallbackException as error:
    print(json.dumps({{"outcome": str(error.__cause__), "count": str(error)}}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tap_traced_inside_a_consumer_fails_at_once_saying_what_to_do(transport):
    process = run_python(NESTED_TAP.format(), devices=1, timeout=60,
                         env={"HOSTCALLBACK_TRANSPORT": transport})
    result = _last_json(process)
    assert "a tap was traced inside a tap consumer or call function" in result["outcome"]
    assert "100 tap consumer call(s) raised" in result["count"]


HEAVY_JAX_UNDER_SHARDED_JIT = PRELUDE + """
heavy = jax.jit(lambda v: v * 3 + 0 * jnp.sum(jnp.ones((256, 256)) @ jnp.ones((256, 256))))
out = run(lambda x: hcb.call(lambda v: np.asarray(heavy(np.asarray(v))), x, result_shape=x),
          "sharded_jit")
print(json.dumps({{"sum": float(out.sum())}}))
"""


@pytest.mark.timeout(120)
@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
@pytest.mark.xfail(strict=True, raises=subprocess.TimeoutExpired,
                   reason="XLA's CPU client does not run this computation while a computation "
                          "over several devices waits for the host (docs/architecture.md, JAX "
                          "inside consumers); if this passes, update the docs")
def test_a_heavier_computation_in_a_call_function_under_a_sharded_jit_hangs():
    run_python(HEAVY_JAX_UNDER_SHARDED_JIT.format(), devices=4, timeout=20)


HEAVY_JAX_WITH_A_TIMEOUT = PRELUDE + """
heavy = jax.jit(lambda v: v * 3 + 0 * jnp.sum(jnp.ones((256, 256)) @ jnp.ones((256, 256))))
ended = []
def host(v):
    out = np.asarray(heavy(np.asarray(v)))
    ended.append(True)
    return out
try:
    run(lambda x: hcb.call(host, x, result_shape=x, timeout=3.0), "sharded_jit")
    outcome = "no error"
except Exception as error:
    outcome = str(error)
later = []
run(lambda x: hcb.id_tap(lambda v, _: later.append(float(v.sum())), x), "sharded_jit")
hcb.barrier_wait()
print(json.dumps({{"outcome": outcome, "function_ended": ended == [True], "later": later}}))
"""


@pytest.mark.timeout(120)
@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_with_a_timeout_the_heavier_computation_fails_saying_why_and_the_receivers_go_on(
        transport):
    """The call's timeout fails the computation with an error that says why; the function's
    JAX work then runs, the function returns (its answer dropped), and later taps arrive."""
    process = run_python(HEAVY_JAX_WITH_A_TIMEOUT.format(), devices=4, timeout=60,
                         env={"HOSTCALLBACK_TRANSPORT": transport})
    result = _last_json(process)
    assert "did not answer this call within its timeout of 3 s" in result["outcome"]
    assert "block_until_ready" in result["outcome"]
    assert result["function_ended"]
    assert result["later"] == [float(sum(range(64)))]


GUIDE = ROOT / "docs" / "architecture.md"


@pytest.mark.timeout(120)
def test_the_architecture_guides_own_thread_example_runs_as_written():
    (example,) = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(),
                            flags=re.DOTALL | re.MULTILINE)
    process = run_python(example, timeout=60)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.startswith("norm 7.4833")  # |(0, 2, 4, 6)| = sqrt(56)
