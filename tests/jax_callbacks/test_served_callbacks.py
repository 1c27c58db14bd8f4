"""The switch (serve_jax_callbacks): JAX's own jax.debug.callback, jax.debug.print, io_callback
and pure_callback lowered to hostcallback's transport, with JAX's semantics. Each case runs the
same program with the switch off (JAX's lowering) and on, and compares what the callbacks got."""

import logging
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import run_pytest, run_python
from hostcallback import _jax
from hostcallback.serving import serve_jax_callbacks, serving_jax_callbacks

pytestmark = pytest.mark.needs_internals("serving JAX's own callbacks")

JAX_TARGET = "xla_ffi_python_cpu_callback"  # JAX's own host callback on CPU
OUR_TARGETS = ("hostcallback_tap", "hostcallback_call")


@pytest.fixture
def served():
    """The switch on for one test, off again after it."""
    serve_jax_callbacks()
    try:
        yield
    finally:
        serve_jax_callbacks(False)


def lowered_text(function, *args) -> str:
    return jax.jit(function).lower(*args).as_text()


def plain(value):
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return (str(np.asarray(value).dtype), np.asarray(value).tolist())
    return value


def on_a_receiver() -> bool:
    return threading.current_thread().name.startswith("hostcallback-receiver")


def calls_both_ways(make_program, *inputs):
    """What the callback got, call by call, with JAX's lowering and with the switch on; each
    run with a fresh jit, so each is lowered with its own setting. Each call's arrays are
    checked to be usable jax.Arrays of the shape they claim, and each run to have taken its
    path (ours: the receiver threads)."""
    received = []
    for on in (False, True):
        calls, threads = [], []

        def record(*args, _calls=calls, _threads=threads, **kwargs):
            for leaf in jax.tree.leaves((args, kwargs)):
                if isinstance(leaf, jax.Array):  # usable as JAX sees it: shape and data agree
                    np.testing.assert_array_equal(np.asarray(leaf + 0), np.asarray(leaf))
            _calls.append(jax.tree.map(lambda v: (plain(v), np.shape(v)), (args, kwargs)))
            _threads.append(on_a_receiver())

        serve_jax_callbacks(on)
        try:
            jax.block_until_ready(make_program(record)(*inputs))
            jax.effects_barrier()
        finally:
            serve_jax_callbacks(False)
        assert threads == [on] * len(threads), "a run did not take the path it was meant to"
        received.append(calls)
    return received


def assert_same_calls(make_program, *inputs, any_order=False):
    theirs, ours = calls_both_ways(make_program, *inputs)
    if any_order:
        theirs, ours = sorted(map(repr, theirs)), sorted(map(repr, ours))
    assert ours == theirs
    assert ours


X = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)


def loop_of_callbacks(record):
    def body(i, c):
        jax.debug.callback(record, c, i, label="step")
        return c + 1
    return jax.jit(lambda x: jax.lax.fori_loop(0, 5, body, x))


# ---- the switch ----------------------------------------------------------------------------


def test_with_the_switch_on_jaxs_callbacks_lower_to_our_handlers(served):
    def program(x):
        jax.debug.callback(lambda v: None, x)
        jax.debug.print("{x}", x=x)
        y = jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return io_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), y)

    text = lowered_text(program, X)
    assert JAX_TARGET not in text
    assert text.count("hostcallback_tap") == 2 and text.count("hostcallback_call") == 2


def test_turned_off_the_next_lowering_is_jaxs_again():
    serve_jax_callbacks()
    assert serving_jax_callbacks()
    serve_jax_callbacks(False)
    assert not serving_jax_callbacks()
    text = lowered_text(lambda x: jax.debug.callback(lambda v: None, x), X)
    assert JAX_TARGET in text and not any(t in text for t in OUR_TARGETS)


def test_a_function_compiled_before_keeps_what_it_was_compiled_with():
    calls = []
    f = jax.jit(lambda x: jax.debug.callback(lambda v: calls.append(threading.current_thread()),
                                             x))
    f(X)  # compiled with JAX's lowering
    serve_jax_callbacks()
    try:
        f(X)
        jax.effects_barrier()
    finally:
        serve_jax_callbacks(False)
    assert calls == [threading.main_thread()] * 2  # JAX's ran it on the dispatching thread


def test_callbacks_run_on_a_receiver_thread_with_jax_arrays_on_the_cpu(served):
    seen = []
    jax.jit(lambda x: jax.debug.callback(
        lambda v: seen.append((threading.current_thread(), v)), x))(X)
    jax.effects_barrier()
    ((thread, value),) = seen
    assert thread is not threading.main_thread()
    assert isinstance(value, jax.Array) and value.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_array_equal(value, X)


def test_results_are_ready_only_once_the_callbacks_ran(served):
    """A loop of steps tens of milliseconds long, still running when block_until_ready is
    called: every callback has run when it returns."""
    seen = []
    heavy = jnp.ones((300, 300))

    def body(i, c):
        c = jnp.tanh(heavy @ c)  # about 10 ms a step on this machine
        jax.debug.callback(lambda i: seen.append(int(i)), i)
        return c

    run = jax.jit(lambda c: jax.lax.fori_loop(0, 10, body, c))
    for _ in range(3):
        seen.clear()
        run(heavy).block_until_ready()
        assert seen == list(range(10))


def test_the_same_calls_as_jaxs_lowering_in_a_loop():
    assert_same_calls(loop_of_callbacks, X)


def test_debug_print_prints_what_jaxs_prints(capfd):
    def program(x):
        jax.debug.print("x={x} sum={s:.2f}", x=x, s=x.sum())
        jax.debug.print("first {}", x[0])

    outputs = []
    for on in (False, True):
        serve_jax_callbacks(on)
        try:
            jax.jit(program)(X)
            jax.effects_barrier()
        finally:
            serve_jax_callbacks(False)
        outputs.append(capfd.readouterr().out)
    assert outputs[1] == outputs[0] and "sum=15.00" in outputs[0]


@pytest.mark.parametrize("ordered", [False, True])
def test_a_print_in_a_batched_while_predicate_prints_what_jaxs_prints(capfd, ordered):
    """JAX lowers such a loop by evaluating the predicate again in the body (and runs finished
    lanes on): its prints show it, so that callback stays JAX's."""
    def count_up(x):
        def predicate(x):
            jax.debug.print("x: {x}", x=x, ordered=ordered)
            return x < 3
        return jax.lax.while_loop(predicate, lambda x: x + 1, x)

    outputs = []
    for on in (False, True):
        serve_jax_callbacks(on)
        try:
            jax.jit(jax.vmap(count_up))(jnp.arange(2)).block_until_ready()
            jax.effects_barrier()
        finally:
            serve_jax_callbacks(False)
        outputs.append(capfd.readouterr().out)
    assert outputs[1] == outputs[0] and outputs[0].count("x: ") > 4


def test_pure_and_io_callbacks_return_their_results_into_the_computation(served):
    def program(x):
        doubled = jax.pure_callback(lambda v: np.asarray(v) * 2,
                                    jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return io_callback(lambda v: np.asarray(v) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype),
                           doubled)

    before = sum(s["records_enqueued"] for s in hcb.queue_stats().values())
    np.testing.assert_array_equal(jax.jit(program)(X), X * 2 + 1)
    assert sum(s["records_enqueued"] for s in hcb.queue_stats().values()) - before == 2


def test_an_unused_pure_callback_is_dropped_and_an_unused_io_callback_is_not(served):
    calls = []

    def program(x):
        jax.pure_callback(lambda v: calls.append("pure") or v,
                          jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        io_callback(lambda v: calls.append("io") or v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return x

    jax.jit(program)(X).block_until_ready()
    assert calls == ["io"]


def test_ordered_io_callbacks_keep_their_order_across_computations(served):
    order = []
    step = jax.jit(lambda i: io_callback(lambda v: order.append(int(v)) or v,
                                         jax.ShapeDtypeStruct((), jnp.int32), i, ordered=True))
    for i in range(20):
        step(jnp.int32(i))
    jax.effects_barrier()
    assert order == list(range(20))


# ---- transformations: JAX's rules stay ------------------------------------------------------


def test_under_vmap_the_callback_is_called_per_element_as_jaxs_rule_says():
    assert_same_calls(lambda record: jax.jit(jax.vmap(lambda x: jax.debug.callback(record, x))),
                      X)


def test_under_grad_the_callback_sees_primal_values_only():
    def make(record):
        def loss(x):
            jax.debug.callback(record, x)
            return jnp.sum(x ** 2)
        return jax.jit(jax.grad(loss))

    assert_same_calls(make, X)


def test_under_checkpoint_the_callback_runs_as_jaxs_does():
    def make(record):
        @jax.checkpoint
        def f(x):
            jax.debug.callback(record, x)
            return jnp.sin(x)
        return jax.jit(jax.grad(lambda x: f(x).sum()))

    assert_same_calls(make, X)


def test_io_callback_under_vmap_runs_per_element(served):
    out = jax.jit(jax.vmap(lambda x: io_callback(lambda v: np.asarray(v) * 3,
                                                 jax.ShapeDtypeStruct((3,), jnp.float32), x)))(X)
    np.testing.assert_array_equal(out, X * 3)


def test_pure_callback_vmap_methods_hand_the_callback_what_jaxs_do():
    for method in ("sequential", "expand_dims", "broadcast_all"):
        def make(record, method=method):
            def f(x):
                return jax.pure_callback(lambda v: (record(v), np.asarray(v))[1],
                                         jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                         vmap_method=method)
            return jax.jit(jax.vmap(f))
        assert_same_calls(make, X)


def test_a_partitioned_callback_in_a_sharded_jit_sees_each_shard():
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i")))
    assert_same_calls(
        lambda record: jax.jit(lambda v: jax.debug.callback(record, v, partitioned=True)), x,
        any_order=True)


def test_a_callback_in_a_sharded_jit_sees_the_whole_value_once():
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i")))
    assert_same_calls(lambda record: jax.jit(lambda v: jax.debug.callback(record, v * 2)), x)


def test_under_pmap_and_shard_map_each_device_calls_with_its_own_values():
    mesh = jax.make_mesh((4,), ("i",))
    xs = jnp.arange(8.0).reshape(4, 2)
    assert_same_calls(lambda record: jax.pmap(lambda v: jax.debug.callback(record, v)), xs,
                      any_order=True)
    assert_same_calls(
        lambda record: jax.jit(jax.shard_map(lambda v: jax.debug.callback(record, v), mesh=mesh,
                                             in_specs=P("i"), out_specs=None)),
        jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i"))), any_order=True)


def test_ordered_callbacks_on_several_devices_are_refused_as_jax_refuses_them(served):
    """JAX refuses them when it lowers the computation; served, our lowering does, with JAX's
    words and ours."""
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("i")))
    for program, value in (
            (jax.pmap(lambda v: jax.debug.callback(lambda a: None, v, ordered=True)),
             jnp.arange(4.0)),
            (jax.jit(lambda v: jax.debug.callback(lambda a: None, v, ordered=True)), x)):
        with pytest.raises(ValueError, match="ordered effects are not supported for more than 1 "
                                             "device.*runs on one device only"):
            program(value)


def test_hostcallback_debugs_ordered_callbacks_on_several_devices_are_refused_too():
    with pytest.raises(ValueError, match="runs on one device only"):
        jax.pmap(lambda v: hcb.debug.callback(lambda a: None, v, ordered=True))(jnp.arange(4.0))


# ---- errors --------------------------------------------------------------------------------


def fails(*args):
    raise ValueError("no good")


def test_a_raising_debug_callback_is_logged_and_fails_its_computation_as_jaxs_does(
        served, caplog):
    step = jax.jit(lambda x: (jax.debug.callback(fails, x), x + 1)[1])
    with caplog.at_level(logging.ERROR), pytest.raises(
            jax.errors.JaxRuntimeError, match="fails raised on .*: ValueError: no good"):
        step(X).block_until_ready()
    assert "jax.debug.callback failed" in caplog.text  # JAX's own log line
    # And once at the barrier (JAX's is not), which a computation without results needs.
    with pytest.raises(hcb.CallbackException, match="no good"):
        jax.effects_barrier()
    ok = jax.jit(lambda x: (jax.debug.callback(lambda v: None, x), x + 1)[1])(X)
    np.testing.assert_array_equal(ok, X + 1)  # the next computation is not failed by it


@pytest.mark.timeout(60)
def test_a_raising_callback_fails_its_own_computation_never_a_later_one(served):
    """The first computation's callbacks outlast the 5 s a computation's end waits for a stuck
    consumer, so it ends, and a longer one runs when its last callback raises: neither fails
    with it (its own has ended), and the barrier reports it."""
    def slow(v):
        time.sleep(5.5)

    def fails(v):
        raise ValueError("no good")

    first = jax.jit(lambda v: (jax.debug.callback(slow, v), jax.debug.callback(fails, v),
                               v + 1)[2])
    heavy = jnp.ones((400, 400)) / 400
    later = jax.jit(lambda c: (jax.debug.callback(lambda v: None, c[0, 0]),
                               jax.lax.fori_loop(0, 1000, lambda i, c: jnp.tanh(c @ c), c))[1])
    later(heavy).block_until_ready()  # compiled
    np.testing.assert_array_equal(first(X), X + 1)  # released after 5 s, before `fails` ran
    later(heavy).block_until_ready()  # runs (seconds) when `fails` raises
    with pytest.raises(hcb.CallbackException, match="no good"):
        jax.effects_barrier()


def test_a_callback_raising_after_a_long_loop_fails_its_computation(served):
    """XLA runs what follows a long loop on one of its worker threads, not the one that began the
    computation: the callback's record names its computation by XLA's execution all the same."""
    heavy = jnp.ones((800, 800)) / 800  # products XLA splits over its threads
    step = jax.jit(lambda c: (jax.debug.callback(fails, jax.lax.fori_loop(
        0, 10, lambda i, c: jnp.tanh(c @ c), c)[0, 0]), c)[1])
    for _ in range(5):
        with pytest.raises(jax.errors.JaxRuntimeError, match="no good"):
            step(heavy).block_until_ready()
        with pytest.raises(hcb.CallbackException, match="no good"):
            jax.effects_barrier()


def test_a_raising_callback_never_fails_a_computation_of_another_thread(served):
    """B begins on another thread while A computes; then A's callback raises: B is not
    failed (A is where its tap's thread tells which computation made it; the barrier reports
    the failure either way)."""
    heavy = jnp.ones((300, 300)) / 300

    def fails(v):
        raise ValueError("no good")

    def loop(c, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ c), c)

    a = jax.jit(lambda c: (jax.debug.callback(lambda v: None, c[0, 0]),
                           jax.debug.callback(fails, loop(c, 300)[0, 0]), c)[2])
    b = jax.jit(lambda c: (jax.debug.callback(lambda v: None, c[0, 0]), loop(c, 600))[1])
    a.lower(heavy).compile()
    b(heavy).block_until_ready()  # compiled
    outcome = {}

    def run(name, program):
        try:
            program(heavy).block_until_ready()
            outcome[name] = "ok"
        except jax.errors.JaxRuntimeError as error:
            outcome[name] = str(error)

    thread_a = threading.Thread(target=run, args=("a", a))
    thread_a.start()
    time.sleep(0.05)
    run("b", b)
    thread_a.join()
    assert outcome["b"] == "ok"
    assert outcome["a"] == "ok" or "no good" in outcome["a"]
    with pytest.raises(hcb.CallbackException, match="no good"):
        jax.effects_barrier()


def test_ordered_callbacks_stay_in_order_when_one_of_them_stays_jaxs(served, capfd):
    def program(x, key):
        for i in range(3):
            jax.debug.print("x {}", x + i, ordered=True)
            jax.debug.print("key {}", key, ordered=True)  # a PRNG key: JAX's own
        return x

    jax.jit(program)(jnp.int32(0), jax.random.key(0)).block_until_ready()
    jax.effects_barrier()
    lines = capfd.readouterr().out.split()
    assert [line for line in lines if line in ("x", "key")] == ["x", "key"] * 3


def test_with_async_delivery_a_raising_debug_callback_is_raised_at_effects_barrier(served):
    with hcb.config.override(delivery="async"):
        step = jax.jit(lambda x: (jax.debug.callback(fails, x), x + 1)[1])
        np.testing.assert_array_equal(step(X), X + 1)  # no end to fail: results were ready
    with pytest.raises(hcb.CallbackException) as raised:
        jax.effects_barrier()
    assert isinstance(raised.value.__cause__, ValueError)
    jax.effects_barrier()  # once


def test_a_raising_io_callback_fails_its_computation(served):
    with pytest.raises(Exception, match="no good"):
        jax.jit(lambda x: io_callback(fails, jax.ShapeDtypeStruct(x.shape, x.dtype), x))(
            X).block_until_ready()
    jax.effects_barrier()  # the computation had the error, as with JAX's lowering
    out = jax.jit(lambda x: io_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x))(X)
    np.testing.assert_array_equal(out, X)  # the receivers go on


def test_a_callback_in_a_partly_manual_shard_map_is_left_to_jax(served):
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    seen = []

    def program(x):
        return jax.shard_map(lambda v: (jax.debug.callback(lambda a: seen.append(np.asarray(a)),
                                                           v), v * 2)[1],
                             mesh=mesh, in_specs=P("a"), out_specs=P("a"), axis_names={"a"})(x)

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("a")))
    text = lowered_text(program, x)
    assert JAX_TARGET in text and not any(t in text for t in OUR_TARGETS)
    np.testing.assert_array_equal(jax.jit(program)(x), np.arange(8.0) * 2)
    jax.effects_barrier()
    assert seen


def test_a_callback_of_a_sub_byte_value_is_left_to_jax_and_the_others_are_served(served):
    text = lowered_text(lambda x: jax.debug.callback(lambda v: None, x.astype(jnp.int4)), X)
    assert JAX_TARGET in text and not any(t in text for t in OUR_TARGETS)
    text = lowered_text(lambda x: (jax.debug.callback(lambda v: None, x.astype(jnp.int4)),
                                   jax.debug.callback(lambda v: None, x)), X)
    assert JAX_TARGET in text and "hostcallback_tap" in text


def test_effects_barrier_still_waits_for_callbacks_served_before_the_switch_went_off():
    seen = []
    heavy = jnp.ones((300, 300))

    def body(i, c):
        c = jnp.tanh(heavy @ c)
        jax.debug.callback(lambda i: seen.append(int(i)), i)
        return c

    run = jax.jit(lambda c: jax.lax.fori_loop(0, 10, body, c))
    serve_jax_callbacks()
    try:  # compiled served, its results ready before its callbacks ran: the barrier must wait
        with hcb.config.override(delivery="async"):
            run(heavy).block_until_ready()
    finally:
        serve_jax_callbacks(False)
    jax.effects_barrier()
    seen.clear()
    run(heavy)  # still running when the barrier is called
    jax.effects_barrier()
    assert seen == list(range(10))


def test_a_callback_with_a_sharding_is_left_to_jax(served):
    device = jax.devices()[0]
    text = lowered_text(lambda x: io_callback(
        lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
        sharding=jax.sharding.SingleDeviceSharding(device)), X)
    assert JAX_TARGET in text


# ---- turning it on without editing the program ----------------------------------------------

PROGRAM = """
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jax.debug.print("x={x}", x=x))
text = f.lower(jnp.arange(3)).as_text()
f(jnp.arange(3))
jax.effects_barrier()
print("served" if "hostcallback_tap" in text else "jax's")
"""


needs_the_installed_pth = pytest.mark.skipif(
    not (Path(hcb.__file__).parent.parent / "hostcallback_jax_callbacks.pth").is_file(),
    reason="the environment variable takes effect through the installed package's .pth file, "
           "and this hostcallback is not installed")


@needs_the_installed_pth
def test_the_environment_variable_serves_a_program_that_never_imports_hostcallback():
    served_run = run_python(PROGRAM, devices=1, env={"HOSTCALLBACK_JAX_CALLBACKS": "1"})
    plain_run = run_python(PROGRAM, devices=1)
    assert served_run.returncode == 0, served_run.stderr[-2000:]
    assert served_run.stdout.splitlines() == ["x=[0 1 2]", "served"]
    assert plain_run.stdout.splitlines() == ["x=[0 1 2]", "jax's"]


@needs_the_installed_pth
@pytest.mark.parametrize("first", ["import hostcallback as hcb; hcb.id_tap",
                                   "import hostcallback.api", "import hostcallback.debug"])
def test_the_environment_variable_serves_a_program_that_imports_hostcallback_first(first):
    result = run_python(first + "\n" + PROGRAM + "import hostcallback as hcb\n"
                        "print(hcb.serving_jax_callbacks())\n",
                        devices=1, env={"HOSTCALLBACK_JAX_CALLBACKS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["x=[0 1 2]", "served", "True"]
    assert "keep JAX's own lowering" not in result.stderr


def test_the_pytest_option_serves_the_test_run(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nhostcallback_jax_callbacks = true\n")
    (tmp_path / "test_served.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def test_served():\n"
        "    text = jax.jit(lambda x: jax.debug.callback(print, x)).lower(jnp.ones(2)).as_text()\n"
        "    assert 'hostcallback_tap' in text\n")
    result = run_pytest(tmp_path, "-q")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.skipif(_jax.PORTABLE, reason="checked in a fresh interpreter below")
def test_the_portable_mode_refuses_the_switch_saying_why():
    result = run_python("from hostcallback.serving import serve_jax_callbacks\n"
                        "serve_jax_callbacks()\n", devices=1,
                        env={"HOSTCALLBACK_PORTABLE": "1"})
    assert result.returncode != 0
    assert "portable mode" in result.stderr and "id_tap" in result.stderr


def test_large_arguments_on_several_devices_do_not_hang(served):
    """1 MiB a device under pmap: JAX's own callbacks hung there (jax#25861)."""
    x = jnp.ones((4, 1 << 18), jnp.float32)

    def double(v):
        return np.asarray(v) * 2

    out = jax.pmap(lambda v: io_callback(double, jax.ShapeDtypeStruct(v.shape, v.dtype), v))(x)
    assert float(out.sum()) == 2 * x.size
    seen = []
    jax.pmap(lambda v: jax.debug.callback(lambda a: seen.append(float(np.asarray(a).sum())),
                                          v))(x)
    jax.effects_barrier()
    assert seen == [float(1 << 18)] * 4


def test_an_exported_function_keeps_jaxs_lowering_and_its_refusal(served):
    """jax.export gets what it gets without the switch: JAX's own answer for its callbacks."""
    def program(x):
        jax.debug.print("{}", x)
        return x

    results = []
    for on in (False, True):
        serve_jax_callbacks(on)
        try:
            results.append(jax.export.export(jax.jit(program))(X).mlir_module())
        except Exception as error:  # noqa: BLE001 - JAX's own refusal, whatever its type
            results.append(type(error).__name__ + str(error)[:60])
    assert results[1] == results[0]
    assert "hostcallback" not in results[1]
