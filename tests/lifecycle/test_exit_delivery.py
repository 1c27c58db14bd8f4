"""Taps still in flight when the program ends are delivered, on every supported Python, with
nothing printed about ignored exceptions (Python 3.12 refuses new threads during exit, so the
exit path must start none). A long exit may say what it waits for; nothing else is printed."""

import pytest

from helpers import run_python

IN_FLIGHT_AT_EXIT = """
    import time
    import jax
    import hostcallback as hcb

    def slow(arg, transforms):
        time.sleep(0.001)
        print(int(arg), flush=True)

    tapped = jax.jit(lambda i: hcb.id_tap(slow, i))
    for i in range(500):
        tapped(i)
    {ending}
    """


@pytest.mark.parametrize("ending", ["pass", "import sys; sys.exit(0)"])
@pytest.mark.parametrize("transport", ["native", "callback"])
@pytest.mark.parametrize("run", range(2))
def test_500_taps_in_flight_at_exit_are_all_delivered_quietly(transport, ending, run):
    result = run_python(IN_FLIGHT_AT_EXIT.format(ending=ending),
                        env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(i) for i in range(500)]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr
