"""A fork() child of a process whose receivers run: it exits at once, quietly, leaving the
parent's queued taps and sinks to the parent, and refuses taps and barriers clearly (its copy of
the receivers has no threads). The parent goes on delivering.

(JAX itself does not run computations in a fork() child: even a plain jitted one hangs there.)"""

import pytest

from helpers import run_python

FORK_PROGRAM = """
    import os, sys, time, warnings
    warnings.simplefilter("ignore")  # JAX warns that fork() and threads do not mix
    import jax
    import hostcallback as hcb
    got = []
    tapped = jax.jit(lambda x: hcb.id_tap(lambda a, t: got.append(int(a)), x))
    tapped(1).block_until_ready()
    pid = os.fork()
    if pid == 0:
        try:
            {child}
            print("child: no error", flush=True)
        except Exception as error:
            print("child:", type(error).__name__, "fork()" in str(error), flush=True)
        sys.exit(0)  # a normal exit: the exit handlers run
    start = time.monotonic()
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), time.monotonic() - start < 3)
    tapped(2).block_until_ready()
    print(got)
    """


def run_fork(child: str):
    result = run_python(FORK_PROGRAM.format(child=child), devices=1,
                        env={"HOSTCALLBACK_EXIT_TIMEOUT": "10"})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines(), result.stderr


@pytest.mark.timeout(120)
def test_a_fork_child_that_does_nothing_exits_at_once_and_quietly():
    lines, stderr = run_fork("pass")
    assert lines == ["child: no error", "child exit 0 True", "[1, 2]"]
    assert "hostcallback" not in stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("child", ["jax.jit(lambda x: hcb.id_tap(print, x))(3)",
                                   "hcb.barrier_wait()"], ids=["tap", "barrier"])
def test_a_fork_child_refuses_taps_and_barriers_naming_fork(child):
    lines, stderr = run_fork(child)
    assert lines == ["child: ReceiverStoppedError True", "child exit 0 True", "[1, 2]"]
    assert "hostcallback" not in stderr


@pytest.mark.timeout(120)
def test_a_fork_waits_until_the_barriers_markers_are_compiled():
    """A fork() right after the receivers start, while the dispatcher compiles the markers, would
    give the child JAX's compilation locks held by a thread it lacks (its jit then hangs)."""
    result = run_python("""
        import os, sys, warnings
        warnings.simplefilter("ignore")
        os.register_at_fork(before=lambda: print("compiled at fork:",
                                                 lifecycle.markers_compiled, flush=True))
        import jax
        import hostcallback as hcb
        from hostcallback.lifecycle import lifecycle
        jax.jit(lambda x: hcb.id_tap(lambda *a: None, x)).lower(1)  # starts the receivers
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        """, devices=1)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["compiled at fork: True"]
