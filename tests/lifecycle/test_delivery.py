"""Ready means handled, and every wait covers the work dispatched before it, from any thread.

Each computation here runs for tens of milliseconds and is still running when the code under
test looks: a loop's results waited for, a script that just ends (also with its loop on a second
thread), a barrier with a timeout, a barrier on another thread, a stop with a timeout, and the
pytest plugin's wait after a test.
"""

import json
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import run_pytest, run_python
from hostcallback import config
from hostcallback._trace import fence

STEPS = 10


def _loop(tap):
    """A loop of STEPS steps of matrix products (several ms each) that taps each step."""

    def body(i, c):
        c = jnp.tanh(c @ c) / 2.0
        tap(i, c)
        return c

    return lambda x: lax.fori_loop(0, STEPS, body, x)


def _slow_loop(tap):
    return jax.jit(_loop(tap))


TAPS = {
    "id_tap": lambda seen: lambda i, c: hcb.id_tap(lambda v, _: seen.append(int(v)), i),
    "debug.callback": lambda seen: lambda i, c: hcb.debug.callback(
        lambda v: seen.append(int(v)), i),
}


@pytest.mark.parametrize("api", sorted(TAPS))
def test_results_ready_means_every_tap_of_the_computation_was_handled(transport, api):
    seen: list[int] = []
    loop = _slow_loop(TAPS[api](seen))
    x = jnp.ones((200, 200)) / 200
    short = 0
    for _ in range(20):
        seen.clear()
        loop(x).block_until_ready()
        short += len(seen) < STEPS
    assert short == 0


def _tapping_step(shape: str, tap):
    """A jitted step of several ms that taps (on every device but in a sharded jit), and its
    input, on one device, under pmap or in a jit sharded over the 4 devices."""
    if shape == "pmap":
        return jax.pmap(_loop(tap)), jnp.ones((4, 200, 200)) / 200
    x = jnp.ones((200, 200)) / 200
    if shape == "sharded jit":
        mesh = jax.make_mesh((4,), ("d",))
        x = jax.device_put(x, NamedSharding(mesh, P("d")))
    return _slow_loop(tap), x


@pytest.mark.needs_internals("a fence on JAX's host callbacks", shape="sharded jit")
@pytest.mark.parametrize("shape", ["one device", "pmap", "sharded jit"])
def test_where_our_fence_has_no_handler_one_of_jaxs_host_callbacks_makes_results_wait(
        monkeypatch, shape):
    """TPU and ROCm have no native fence; there, with HOSTCALLBACK_CALLBACK_FENCE=1, the
    callback transport's taps are waited for by a host callback of JAX's
    (transport/callback.py: lower_fence). The CPU is made one of them here."""
    monkeypatch.setattr(fence, "FENCED_PLATFORMS", frozenset())
    monkeypatch.setattr(fence, "CALLBACK_FENCED_PLATFORMS", frozenset({"cpu"}))
    seen: list[int] = []

    def slow(value, _):
        time.sleep(0.01)
        seen.append(int(value))

    with config.override(transport="callback"):
        step, x = _tapping_step(shape, lambda i, c: hcb.id_tap(slow, i))
        lowered = step.lower(x).as_text()
        assert "hostcallback_fence" not in lowered and "hostcallback_begin" not in lowered
        for _ in range(3):
            seen.clear()
            step(x).block_until_ready()
            assert len(seen) == STEPS * (4 if shape == "pmap" else 1)


@pytest.mark.needs_internals("a fence on JAX's host callbacks")
@pytest.mark.parametrize("flag", ["", "1"], ids=["by default", "HOSTCALLBACK_CALLBACK_FENCE=1"])
def test_the_callback_fence_serves_tpu_and_rocm_only_where_asked_for(flag):
    result = run_python("from hostcallback._trace import fence\n"
                        "print(sorted(fence.CALLBACK_FENCED_PLATFORMS))",
                        env={"HOSTCALLBACK_CALLBACK_FENCE": flag})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == (["['rocm',", "'tpu']"] if flag else ["[]"])


def test_id_print_has_printed_once_the_result_is_ready(transport, capsys):
    loop = _slow_loop(lambda i, c: hcb.id_print(i, what="step"))
    for _ in range(5):
        np.asarray(loop(jnp.ones((200, 200)) / 200))
        assert capsys.readouterr().out.count("what: step") == STEPS


def test_async_delivery_makes_results_ready_before_their_taps_are_handled(transport):
    held, release = threading.Event(), threading.Event()

    def hold(value, _):
        held.set()
        release.wait(30)

    with config.override(delivery="async"):
        stuck_loop = _slow_loop(lambda i, c: hcb.id_tap(hold, i))
        stuck_loop(jnp.ones((200, 200))).block_until_ready()
    assert held.wait(30) and not release.is_set()  # ready while its first tap is still held
    release.set()
    hcb.barrier_wait(timeout=60)


@pytest.mark.needs_internals('delivery="dispatch"')
def test_dispatch_delivery_makes_the_dispatching_call_wait_for_the_taps(transport):
    seen: list[float] = []

    def slow(value, _):
        time.sleep(0.2)
        seen.append(float(value))

    tapped = jax.jit(lambda x: hcb.id_tap(slow, (x @ x).sum()))
    x = jnp.ones((200, 200))
    with config.override(delivery="dispatch"):  # compiled, and so lowered, here
        tapped(x).block_until_ready()
    seen.clear()
    tapped(x)
    assert len(seen) == 1  # as jax.debug.callback on CPU: dispatch ran the whole computation


def test_a_delivery_that_does_not_exist_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="delivery='later': choose one of handled, dispatch"):
        hcb.configure(delivery="later")
    result = run_python("import hostcallback", env={"HOSTCALLBACK_DELIVERY": "later"})
    assert result.returncode != 0
    assert "HOSTCALLBACK_DELIVERY='later': choose one of handled, dispatch, async" in result.stderr


NESTED = """
import sys, time, jax, jax.numpy as jnp
import hostcallback as hcb

inner = jax.jit(lambda x: hcb.id_tap(lambda v, _: print("inner tap", flush=True), (x @ x).sum()))
x = jnp.ones((200, 200))
inner(x).block_until_ready()   # compiled here, outside any consumer

def consumer(v, _):            # runs a tapped computation on its own device, and waits for it
    start = time.monotonic()
    inner(x).block_until_ready()
    print(f"inner ready after {time.monotonic() - start:.0f} s", flush=True)

jax.jit(lambda x: hcb.id_tap(consumer, x.sum()))(x).block_until_ready()
hcb.barrier_wait(timeout=60)
print("done", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_consumer_waiting_for_its_own_devices_tapped_computation_is_released_saying_so():
    result = run_python(NESTED, devices=1, timeout=100)
    if "was traced inside a tap consumer" in result.stderr:
        return  # a JAX that traces it again there (0.12): refused at once, saying what to do
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done" in result.stdout and result.stdout.count("inner tap") == 2, result.stdout
    assert re.search(r"inner ready after [5-9] s", result.stdout), result.stdout
    assert "goes on without them" in result.stderr, result.stderr[-3000:]


LATER_STATE = """
import re, time, jax, jax.numpy as jnp
import hostcallback as hcb

state = {"x": jnp.ones((200, 200))}

def checkpoint(step, _):       # reads the newest state, which a later step is still computing
    if int(step) == 1:
        start = time.monotonic()
        jax.block_until_ready(state["x"])
        print(f"checkpointed after {time.monotonic() - start:.0f} s", flush=True)

step_fn = jax.jit(lambda x, i: (hcb.id_tap(checkpoint, i), (x @ x) / 200)[1])
for i in range(4):
    state["x"] = step_fn(state["x"], i)
jax.block_until_ready(state["x"])
hcb.barrier_wait(timeout=60)
print("done", hcb.queue_stats()[jax.devices()[0]]["fences_released"] >= 1, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_consumer_waiting_for_a_later_steps_results_is_released_saying_so():
    result = run_python(LATER_STATE, devices=1, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    if "checkpointed after 0 s" in result.stdout:
        return  # a JAX that dispatched the steps one after another (0.12): nothing to wait for
    assert "done True" in result.stdout, result.stdout
    assert re.search(r"checkpointed after [5-9] s", result.stdout), result.stdout
    assert "goes on without them" in result.stderr, result.stderr[-3000:]


LONG = """
import jax, jax.numpy as jnp, time
from jax import lax
import hostcallback as hcb

def long_step(x):
    x = lax.fori_loop(0, {rounds}, lambda i, c: jnp.tanh(c @ c) / 2, x)
    return hcb.id_tap(lambda v, _: print("tapped", flush=True), x.sum())
"""

SCRIPT_THAT_JUST_ENDS = LONG + """
def loop():
    x = jnp.ones((300, 300)) / 300
    for step in range(20):
        x = jax.jit(long_step)(x) * jnp.ones((300, 300))
{start}
"""

# Python 3.12 and later refuse new threads once the main thread has ended: the receivers start
# when a tap is first traced, so the step is traced on the main thread first.
TRACED_ON_THE_MAIN_THREAD = "jax.jit(long_step).lower(jnp.ones((300, 300)))\n"


@pytest.mark.timeout(240)
@pytest.mark.needs_internals("waits that cover computations dispatched from another thread whose "
                             "results nobody holds", where="second thread")
@pytest.mark.parametrize("where", ["main thread", "second thread"])
@pytest.mark.parametrize("transport", ["native", "callback"])
def test_a_script_that_just_ends_delivers_every_tap_of_its_loop(transport, where):
    start = "loop()" if where == "main thread" else (
        TRACED_ON_THE_MAIN_THREAD + "import threading\nthreading.Thread(target=loop).start()")
    result = run_python(SCRIPT_THAT_JUST_ENDS.format(rounds=20, start=start), devices=1,
                        env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split().count("tapped") == 20, result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr


# A loop compiled and run on a thread; the script ends once it has dispatched its steps.
# A step that taps a reduction of its one result is compiled twice on JAX 0.10 and later
# (compile_rescue.py), and its first run then begins tens of milliseconds after the last step was
# dispatched: when the script ends no tapped computation has begun on any device yet.
SCRIPT_WHOSE_FIRST_STEP_BEGINS_LATE = """
import threading
import jax, jax.numpy as jnp
import hostcallback as hcb

@jax.jit
def step(x, i):
    for _ in range(12):
        x = jnp.tanh(x @ x / 512.0)
    hcb.id_tap(lambda v, _: print("tapped", flush=True), jnp.sum(x) + i)
    return x

def loop():
    x = jnp.eye(512)
    for i in range(20):
        x = step(x, i)

step.trace(jnp.eye(512), 0)  # the receivers start (Python 3.12 refuses it once main has ended)
threading.Thread(target=loop).start()
"""


@pytest.mark.timeout(240)
@pytest.mark.needs_internals("waits that cover computations dispatched from another thread whose "
                             "results nobody holds")
def test_a_script_whose_loop_on_a_thread_has_not_begun_a_tapped_step_delivers_every_tap():
    result = run_python(SCRIPT_WHOSE_FIRST_STEP_BEGINS_LATE, devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split().count("tapped") == 20, result.stderr[-3000:]


STOP_RIGHT_AFTER_A_LOWERING = """
    import jax, jax.numpy as jnp
    import hostcallback as hcb

    x = jnp.arange(3.0)
    hcb.barrier_wait()  # what a barrier dispatches itself is compiled, x is ready
    jax.jit(lambda x: hcb.id_tap(lambda *a: None, x * 3)).lower(x)  # lowered, never run
    hcb.stop_outfeed_receiver(timeout=1)
    print("stopped")
    """


@pytest.mark.needs_internals("waits that cover computations dispatched from another thread whose "
                             "results nobody holds")
def test_a_stop_with_a_timeout_right_after_a_tapped_function_was_lowered_stops_in_time():
    # Its barrier waits a while for that function's first run to begin (up to 1 s at stop, but
    # at most half of its own time): then it goes on, without timing out.
    result = run_python(STOP_RIGHT_AFTER_A_LOWERING, devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stopped" in result.stdout
    assert "timed out" not in result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.needs_internals("waits that cover computations dispatched from another thread whose "
                             "results nobody holds")
def test_a_loop_first_traced_on_a_thread_after_the_main_thread_ended_delivers_or_says_why():
    # Python 3.12 refuses new threads once the main thread has ended (3.11 and 3.13 do not): the
    # receivers, which start when a tap is first traced, then cannot start.
    start = "import threading\nthreading.Thread(target=loop).start()"
    result = run_python(SCRIPT_THAT_JUST_ENDS.format(rounds=20, start=start), devices=1)
    if result.stdout.split().count("tapped") != 20:
        assert "cannot start its receiver threads: the interpreter is exiting" in \
            result.stderr, result.stderr[-3000:]
        assert "trace the tapping code once on the main thread" in result.stderr


GIVES_UP = LONG + """
def slow(v, _):
    time.sleep(0.2)

def step(x):
    x = lax.fori_loop(0, {rounds}, lambda i, c: jnp.tanh(c @ c) / 2, x)
    hcb.id_tap(slow, x.sum())
    return x * jnp.ones_like(x)

x = jnp.ones((300, 300)) / 300
for i in range(30):
    x = jax.jit(step)(x)
"""


@pytest.mark.timeout(120)
def test_an_exit_that_gives_up_on_running_computations_says_so_and_jax_prints_nothing():
    # (On the callback transport on CPU, jaxlib runs each step while dispatching it, as it runs
    # any computation with JAX's host callbacks: nothing is left running at exit.)
    result = run_python(GIVES_UP.format(rounds=5), devices=1, timeout=100,
                        env={"HOSTCALLBACK_EXIT_TIMEOUT": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the taps of computations still running are dropped" in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, \
        result.stderr[-3000:]


WAITS_AFTER_DISPATCH = LONG + """
import json, threading, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

how, shape = {how!r}, {shape!r}
x = jnp.ones((256, 256)) / 256
if shape == "one device":
    out = jax.jit(long_step)(x)
elif shape == "pmap":
    out = jax.pmap(long_step)(jnp.stack([x] * 4))
else:
    mesh = jax.make_mesh((4,), ("i",))
    out = jax.jit(long_step)(jax.device_put(jnp.stack([x] * 4), NamedSharding(mesh, P("i"))))
ready_before = out.is_ready()
if {drop_result!r}:  # nobody holds the result: the running computation must be seen itself
    del out
    time.sleep(0.05)
if how == "barrier with a timeout":
    hcb.barrier_wait(timeout=60)
elif how == "barrier on another thread":
    waiter = threading.Thread(target=hcb.barrier_wait)
    waiter.start()
    waiter.join()
else:
    hcb.stop_outfeed_receiver(timeout=60)
print(json.dumps({{"ready_before": ready_before}}), flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.needs_internals("taps in a jit over a sharded mesh", shape="sharded jit")
@pytest.mark.parametrize("shape", ["one device", "pmap", "sharded jit"])
@pytest.mark.parametrize("how", ["barrier with a timeout", "barrier on another thread",
                                 "stop with a timeout"])
def test_waits_cover_a_computation_still_running(how, shape):
    result = run_python(WAITS_AFTER_DISPATCH.format(rounds=60, how=how, shape=shape,
                                                    drop_result=False), devices=4)
    assert result.returncode == 0, result.stderr[-3000:]
    before_report, report = result.stdout.rsplit("{", 1)
    assert not json.loads("{" + report)["ready_before"], "it had finished: the test proves nothing"
    # (Receivers of several devices print at once: their lines may run together.)
    assert before_report.count("tapped") == (4 if shape == "pmap" else 1), result.stdout


@pytest.mark.timeout(240)
@pytest.mark.needs_internals("waits that cover computations dispatched from another thread whose "
                             "results nobody holds")
@pytest.mark.parametrize("how", ["barrier on another thread", "stop with a timeout"])
def test_waits_cover_a_running_computation_whose_result_nobody_holds(how):
    result = run_python(WAITS_AFTER_DISPATCH.format(rounds=60, how=how, shape="one device",
                                                    drop_result=True), devices=4)
    assert result.returncode == 0, result.stderr[-3000:]
    before_report, report = result.stdout.rsplit("{", 1)
    assert not json.loads("{" + report)["ready_before"], "it had finished: the test proves nothing"
    assert before_report.count("tapped") == 1, result.stdout


PLUGIN_SAMPLE = """
    import jax, jax.numpy as jnp
    from jax import lax
    import hostcallback as hcb

    def broken(arg, transforms):
        raise ValueError("consumer broke after the test")

    def test_leaves_a_tapping_computation_running():
        x = jnp.ones((300, 300)) / 300
        jax.jit(lambda x: hcb.id_tap(broken, lax.fori_loop(
            0, 60, lambda i, c: jnp.tanh(c @ c) / 2, x).sum()))(x)

    def test_the_next_one():
        pass
    """


@pytest.mark.timeout(240)
def test_the_plugin_fails_the_test_that_left_a_failing_tap_running(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "\n".join(line[4:] for line in PLUGIN_SAMPLE.splitlines()))
    result = run_pytest(tmp_path, "-rA", "test_sample.py")
    assert "consumer broke after the test" in result.stdout, result.stdout[-3000:]
    assert "FAILED test_sample.py::test_leaves_a_tapping_computation_running" in result.stdout
    assert "PASSED test_sample.py::test_the_next_one" in result.stdout
