"""A call function that itself runs jitted JAX work, with steps dispatched back to back (EvoX's
pattern): it finishes wherever JAX's own callbacks finish it, on both transports; where it cannot
(a computation over several devices waiting while the function's work needs those devices, which
hangs with jax.pure_callback too), a pmap call with a timeout fails with an error that says why."""

import pytest
from conftest import TRANSPORTS, run_python

EVOX_STEPS = """
import jax, jax.numpy as jnp, numpy as np
import hostcallback as hcb

inner = jax.jit(lambda p: jnp.sum(p, axis=1))   # the "problem", evaluated on the host side
timeout = {timeout}

def fitness(pop):
    return hcb.call(lambda p: np.asarray(inner(p)), pop, timeout=timeout,
                    result_shape=jax.ShapeDtypeStruct(pop.shape[:1], jnp.float32))

scenario = {scenario!r}
sharded = None
if scenario == "sharded_jit":  # the population split over 4 devices
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))

def step(key):
    key, sub = jax.random.split(key)
    pop = jax.random.uniform(sub, (20, 2))
    if sharded is not None:
        pop = jax.lax.with_sharding_constraint(jnp.tile(pop, (4, 1)), sharded)
    return key, fitness(pop).min()

run = jax.pmap(step) if scenario == "pmap" else jax.jit(step)
key = jax.random.PRNGKey(0)
if scenario == "pmap":
    key = jax.random.split(key, 4)
try:
    for i in range(200):
        key, best = run(key)          # no block_until_ready between steps
    print("ok", float(jnp.min(best)))
except Exception as error:
    print("failed:", str(error)[-900:].replace("\\n", " "))
"""


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("native calls run synchronously (a function that runs JAX work "
                             "with steps dispatched back to back)", transport="native")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("devices", [1, 4])
def test_a_call_that_runs_jax_finishes_with_steps_dispatched_back_to_back(transport, devices):
    result = run_python(EVOX_STEPS.format(scenario="jit", timeout=None), devices=devices,
                        timeout=120, env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok 0.040218"), result.stdout


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("native calls run synchronously (a function that runs JAX work "
                             "with steps dispatched back to back)", transport="native")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scenario", [
    "pmap",
    pytest.param("sharded_jit", marks=pytest.mark.xfail(
        strict=False, reason="the other devices wait in a collective that XLA's CPU client ends "
                             "by terminating the process after 40 s, before any call timeout "
                             "can speak (docs/architecture.md, JAX inside consumers)")),
])
def test_where_it_cannot_finish_a_call_with_a_timeout_fails_saying_why(transport, scenario):
    result = run_python(EVOX_STEPS.format(scenario=scenario, timeout=5.0), devices=4,
                        timeout=150, env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("ok"):
        return  # it finished: timing let XLA run the function's work
    assert "did not answer this call within its timeout of 5 s" in result.stdout, result.stdout
    assert "block_until_ready" in result.stdout, result.stdout
