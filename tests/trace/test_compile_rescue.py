"""A computation XLA's CPU compiler refuses for its own bug (a callback takes a reduction of the
computation's one result: JAX 0.10 and later) is compiled again without the pass that has it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from helpers import run_python

pytestmark = pytest.mark.needs_internals(
    "compiling a computation again (a change to JAX's compile)")

ROWS = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096


def test_a_tap_of_a_reduction_of_the_result_compiles_and_delivers(transport):
    seen = []

    @jax.jit
    def step(x):
        y = jnp.tanh(x) + 1
        hcb.id_tap(lambda v, _: seen.append(float(v)), jnp.mean(y))
        return y

    out = step(ROWS)
    hcb.barrier_wait()
    np.testing.assert_allclose(seen, [float(np.mean(np.tanh(ROWS) + 1))], rtol=1e-5)
    np.testing.assert_allclose(out, np.tanh(ROWS) + 1, rtol=1e-6)


def test_jax_debug_callback_of_a_reduction_of_the_result_compiles_too_once_taps_are_in_use():
    jax.jit(lambda x: hcb.id_tap(lambda *a: None, x)).lower(1.0)  # taps in use
    seen = []

    @jax.jit
    def step(x):
        y = x @ x
        jax.debug.callback(lambda v: seen.append(float(v)), jnp.sum(y))
        return y

    step(ROWS).block_until_ready()
    jax.effects_barrier()
    np.testing.assert_allclose(seen, [float(np.sum(ROWS @ ROWS))], rtol=1e-4)


ANOTHER_COMPILE_ERROR = """
    import jax, jax.numpy as jnp
    from jax._src import compiler
    import hostcallback as hcb
    from hostcallback._trace import compile_rescue

    jax.jit(lambda x: hcb.id_tap(lambda *a: None, x)).lower(1.0)  # taps in use: the rescue too
    xla_compile = compiler.backend_compile_and_load.hostcallback_wraps
    compiles = []  # XLA's compiles, counted below the rescue

    def counted(backend, module, executable_devices, options, host_callbacks):
        compiles.append(1)
        return xla_compile(backend, module, executable_devices, options, host_callbacks)

    compiler.backend_compile_and_load = counted
    compile_rescue.install()  # the rescue again, around the count
    assert compiler.backend_compile_and_load.hostcallback_wraps is counted

    call = jax.ffi.ffi_call("hostcallback_no_such_target", jax.ShapeDtypeStruct((), jnp.float32))
    lowered = jax.jit(lambda x: call(x)).lower(jnp.float32(1))
    before = len(compiles)
    try:
        lowered.compile()
    except Exception as error:
        print("refused:", "hostcallback_no_such_target" in str(error))
    print("compiles:", len(compiles) - before)
    """


def test_another_compile_error_is_not_retried():
    result = run_python(ANOTHER_COMPILE_ERROR, devices=1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused: True" in result.stdout
    assert "compiles: 1" in result.stdout
    assert "compiled it again" not in result.stderr


RESCUED_TWICE = """
    import jax, jax.numpy as jnp
    import hostcallback as hcb

    def step(x):
        y = jnp.tanh(x) + 1
        hcb.id_print(jnp.mean(y), what="mean")
        return y

    jax.jit(step)(jnp.ones((64, 64)))
    jax.jit(lambda x: step(x) * 2 + 0 * jnp.sum(step(x)))(jnp.ones((64, 64)))
    jax.jit(lambda x: step(x + 1))(jnp.ones((64, 64)))
    hcb.barrier_wait()
    """


def test_the_rescue_is_said_once_on_the_hostcallback_logger():
    result = run_python(RESCUED_TWICE, devices=1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("what: mean") == 4
    if jax.__version_info__ >= (0, 10):  # where XLA has the bug
        assert result.stderr.count("compiled it again without those fusions") == 1
