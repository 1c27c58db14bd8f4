"""No abort at interpreter exit: a thread of ours that comes back from a section without the GIL
after finalization has begun parks instead of being ended by CPython (whose forced unwind through
a noexcept frame aborted the process, rc 134). A thread that passed that check just before
finalization began and waits for the GIL when it begins cannot be saved that way: for the
receivers, which run the consumers, exit's handler closes the exit gate once it has delivered
what it could, and a receiver that comes back after that parks. Each case runs in fresh
interpreters; HOSTCALLBACK_EXIT_RUNS sets how many for the cases that import JAX (50 by hand, see
the "Reliability" document)."""

import os
import subprocess
import sys

import pytest

from helpers import run_python

RUNS = int(os.environ.get("HOSTCALLBACK_EXIT_RUNS", "3"))

DRAINING_WHILE_FINALIZATION_RUNS_ON = """
    import os, sys, threading, time, types
    from hostcallback._native import outfeed

    def wait_in_drain():
        while True:
            outfeed.drain(3, 16, 1 << 20, 1.0, platform="cpu")

    class SlowToFinalize:
        def __del__(self, sleep=time.sleep, write=os.write):
            sleep(1.5)  # finalization runs on past the drain's timeout, GIL released
            write(1, b"finalization ran on")

    # Held by a module of its own, which finalization clears (an object in __main__ was not
    # finalized while the thread ran).
    held = types.ModuleType("held_until_finalization")
    held.slow = SlowToFinalize()
    sys.modules[held.__name__] = held
    del held
    threading.Thread(target=wait_in_drain, daemon=True).start()
    # Finalization begins while the drain waits without the GIL, a second before it comes back.
    # (A drain that came back just before could be waiting for the GIL when finalization
    # begins: the case that no one can save.)
    while outfeed.stats(3, platform="cpu")["receivers_waiting"] == 0:
        time.sleep(0.001)
    """


@pytest.mark.timeout(300)
def test_a_thread_waiting_in_drain_while_finalization_runs_on_does_not_abort():
    results = [run_python(DRAINING_WHILE_FINALIZATION_RUNS_ON, timeout=60) for _ in range(20)]
    # The head of stderr: a sanitizer's report starts with the error and its stack.
    assert [(r.returncode, r.stderr[:3000]) for r in results if r.returncode] == []
    assert {r.stdout for r in results} == {"finalization ran on"}


RECEIVER_WAITING_FOR_THE_GIL_AS_FINALIZATION_BEGINS = """
    import atexit, os, sys, threading, time, types

    # No thread asks another for the GIL: it changes hands only where its holder waits.
    sys.setswitchinterval(1000)

    def hold_the_gil(write=os.write):
        # The last exit handler (registered first): keeps the GIL while the receiver's frame
        # is filled, so the receiver waits for the GIL as finalization begins.
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
        write(1, b"finalization begins")

    atexit.register(hold_the_gil)

    import jax
    import numpy as np
    from jax import tree_util
    import hostcallback as hcb
    from hostcallback._records.registry import Consumer
    from hostcallback.addons import RecordBatch
    from hostcallback.consumer.frame_templates import make_template
    from hostcallback.consumer.native_frames import frames
    assert frames is not None, "the compiled framer (which releases the GIL) must be there"

    value = np.ones(20_000_000, np.uint8)  # its frame is filled without the GIL
    batch = RecordBatch([(1, 0, 0, 0, (value,))], 0, 1,
                        Consumer(func=print, treedef=tree_util.tree_structure(value)), device=None)
    template = make_template(batch, {"name": "x", "metadata": {}, "process": 0, "host": "h",
                                     "device": "d", "device_id": 0})
    framing = threading.Event()

    def frames_until_the_end(arg, transforms):  # a sink's work, past exit's deadline
        framing.set()
        while True:
            template.frames(batch)

    class SleepsDuringFinalization:
        def __del__(self, sleep=time.sleep):
            sleep(0.3)  # gives the GIL away while the interpreter finalizes

    # Held by a module of its own, which finalization clears (this script's globals outlive it).
    held = types.ModuleType("held_until_finalization")
    held.sleeper = SleepsDuringFinalization()
    sys.modules[held.__name__] = held
    del held
    jax.jit(lambda x: hcb.id_tap(frames_until_the_end, x))(1.0)
    framing.wait()
    """


@pytest.mark.timeout(300)
def test_a_receiver_waiting_for_the_gil_as_finalization_begins_parks_without_abort():
    """The receiver's consumer frames records (C++, without the GIL) past exit's deadline; the
    last exit handler keeps the GIL until the frame is filled, so without the exit gate the
    receiver waits for the GIL when finalization begins and is ended there (abort, 3 of 3).
    Two busy processes load the cores meanwhile: exit's barrier then gives up while its
    dispatcher is still inside jaxlib, behind the computation that waits for that receiver,
    which aborted 7 of 8 runs before exit waited for the dispatcher too."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for _ in range(3):  # one of them aborted 7 of 8 times before the fix
            result = run_python(RECEIVER_WAITING_FOR_THE_GIL_AS_FINALIZATION_BEGINS,
                                env={"HOSTCALLBACK_EXIT_TIMEOUT": "0.5"}, timeout=120)
            assert result.returncode == 0, result.stderr[-3000:]
            assert "terminate called" not in result.stderr
            assert result.stdout == "finalization begins"
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


KEYBOARD_INTERRUPT_WITHOUT_A_BARRIER = """
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import jax
    import hostcallback as hcb

    def interrupted(arg, transforms):
        raise KeyboardInterrupt

    step = jax.jit(lambda x: hcb.id_tap(interrupted, x))
    try:
        for i in range(2000):
            step(i)
    except KeyboardInterrupt:
        pass
    """


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["native", "callback"])
def test_a_keyboard_interrupt_in_a_consumer_and_no_barrier_exits_without_abort(transport):
    for _ in range(RUNS):
        result = run_python(KEYBOARD_INTERRUPT_WITHOUT_A_BARRIER,
                            env={"HOSTCALLBACK_TRANSPORT": transport,
                                 "HOSTCALLBACK_EXIT_TIMEOUT": "2"}, timeout=120)
        assert result.returncode in (0, 1), result.stderr[-2000:]
        assert "terminate called" not in result.stderr
        assert "exception not rethrown" not in result.stderr


FAILED_CALL_IN_A_SHARDED_JIT = """
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import hostcallback as hcb

    mesh = jax.make_mesh((4,), ("d",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
    def bad(v):
        raise ValueError("boom")
    try:
        jax.jit(lambda x: (hcb.call(bad, x, result_shape=()), x * 2)[1])(x).block_until_ready()
    except Exception as error:
        print("failed:", "ValueError: boom" in str(error))
    """


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["native", "callback"])
@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
def test_a_failed_call_in_a_sharded_jit_exits_without_abort(transport):
    for _ in range(RUNS):
        result = run_python(FAILED_CALL_IN_A_SHARDED_JIT,
                            env={"HOSTCALLBACK_TRANSPORT": transport}, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "failed: True"
