"""A call function that itself runs jitted JAX work, with steps dispatched back to back (EvoX's
pattern): it finishes wherever JAX's own callbacks finish it, on both transports; where it cannot
(the function's work queued behind the next step on a device the computation waits on, which
hangs with jax.pure_callback too), a call with a timeout fails with an error that says why and
that blocking each step avoids it, never with XLA ending the process on the native transport;
blocked steps finish under a sharded jit too."""

import pytest

from helpers import TRANSPORTS, run_python

EVOX_STEPS = """
import sys
import jax, jax.numpy as jnp, numpy as np
import hostcallback as hcb

inner = jax.jit(lambda p: jnp.sum(p, axis=1))   # the "problem", evaluated on the host side
timeout = {timeout}

def evaluate(p):  # says on stderr when a call's function begins and ends
    print("call function begins", file=sys.stderr, flush=True)
    fit = np.asarray(inner(p))
    print("call function ends", file=sys.stderr, flush=True)
    return fit

def fitness(pop):
    return hcb.call(evaluate, pop, timeout=timeout,
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
blocked = {blocked}
try:
    for i in range(200):
        key, best = run(key)          # no block_until_ready between steps, unless blocked
        if blocked:
            jax.block_until_ready(key)
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
    result = run_python(EVOX_STEPS.format(scenario="jit", timeout=None, blocked=False),
                        devices=devices, timeout=120, env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok 0.040218"), result.stdout


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("calls in a jit over a sharded mesh", transport="native")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_under_a_sharded_jit_it_finishes_when_each_step_is_waited_for(transport):
    result = run_python(EVOX_STEPS.format(scenario="sharded_jit", timeout=None, blocked=True),
                        devices=4, timeout=120, env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok 0.040218"), result.stdout


# XLA's rendezvous limit, lowered from 40 s: where XLA's CPU client stops in a collective (the
# callback transport's shared call sums its answer over the devices), it ends the process then.
RENDEZVOUS_LIMIT_FLAGS = ("--xla_force_host_platform_device_count=4 "
                          "--xla_cpu_collective_call_terminate_timeout_seconds=15")
TIMED_OUT = "did not answer this call within its timeout of 5 s"
PARTS_MISSING = "of the 4 devices of a sharded computation reached this call within 5 s"


def run_back_to_back(scenario: str, transport: str):
    return run_python(EVOX_STEPS.format(scenario=scenario, timeout=5.0, blocked=False),
                      devices=4, timeout=150,
                      env={"HOSTCALLBACK_TRANSPORT": transport,
                           "XLA_FLAGS": RENDEZVOUS_LIMIT_FLAGS})


def assert_finished_or_failed_saying_why(result, *, finished: str, shared: bool,
                                         xla_may_end_it: bool) -> None:
    """It finished with the right answer; or the call's timeout failed the step with an error
    that says why (for a call shared over a sharded computation's devices, on stderr at once
    too, or that some device's part never came); or, only where the program holds an XLA
    collective, XLA's CPU client stopped in it while no call was left unanswered and XLA ended
    the process, saying so."""
    if result.returncode != 0:
        assert xla_may_end_it, result.stderr[-3000:]
        assert result.returncode == -6, result.stderr[-3000:]  # SIGABRT from XLA's check
        assert "Termination timeout for" in result.stderr, result.stderr[-3000:]
        begun = result.stderr.count("call function begins")
        ended = result.stderr.count("call function ends")
        assert begun == ended or TIMED_OUT in result.stdout, result.stderr[-3000:]
        return
    if result.stdout.startswith("ok"):
        assert result.stdout.startswith(finished), result.stdout
        return  # timing let XLA run the function's work
    assert "block_until_ready" in result.stdout, result.stdout
    if shared and PARTS_MISSING in result.stdout:
        return
    assert TIMED_OUT in result.stdout, result.stdout
    if shared:
        assert TIMED_OUT in result.stderr and "every device fails with this error" in \
            result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("native calls run synchronously (a function that runs JAX work "
                             "with steps dispatched back to back)", transport="native")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_under_pmap_back_to_back_a_call_with_a_timeout_fails_saying_why(transport):
    """The function's work queues on its device behind the next step, which waits for this
    one: the call's timeout fails the step saying why. The step holds no XLA collective on the
    native transport; once, on a loaded machine, the callback transport's stopped in an
    all-reduce before any call, as under a sharded jit (below)."""
    assert_finished_or_failed_saying_why(run_back_to_back("pmap", transport), shared=False,
                                         finished="ok 0.314789",
                                         xla_may_end_it=transport == "callback")


@pytest.mark.timeout(200)
@pytest.mark.needs_internals("native calls run synchronously (a function that runs JAX work "
                             "with steps dispatched back to back)", transport="native")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_under_a_sharded_jit_back_to_back_it_never_hangs(transport):
    """The function's work queues on device 0 behind the next step, which waits for this one.
    The call's timeout then fails the step saying why, and says so on stderr at once; or XLA's
    CPU client leaves one device's part of a step unstarted, and the call fails within its
    timeout saying so (native: its parts meet in our handler, no XLA collective is left in the
    step); on the callback transport, whose devices share the answer in an XLA collective, XLA
    ends the process after its rendezvous limit instead, saying so, as it does every time with
    JAX's own pure_callback. Either way within the deadline."""
    assert_finished_or_failed_saying_why(run_back_to_back("sharded_jit", transport), shared=True,
                                         finished="ok 0.040218",
                                         xla_may_end_it=transport == "callback")
