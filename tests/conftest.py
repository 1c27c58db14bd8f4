"""Test set-up: four CPU devices for every test, both transports for behaviour tests.

Fixtures, hooks and markers only; the helpers tests share are in helpers.py."""

import os

# Must happen before jax is imported anywhere in the test process. JAX_PLATFORMS pins the CPU
# backend, so a machine with a GPU runs the same tests (and the native transport) as CI.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import pytest

from helpers import TRANSPORTS, Collector
from hostcallback import _jax, config


def pytest_configure(config):
    """A run that did not ask for the portable mode must not fall into it unseen: every test of
    what it lacks would be skipped and the run would pass on a broken default mode."""
    if _jax.PORTABLE and not _jax.PORTABLE_REQUESTED:
        pytest.exit(f"hostcallback fell back to its portable mode ({_jax.PORTABLE_REASON}); set "
                    "HOSTCALLBACK_PORTABLE=1 to test that mode on purpose", returncode=1)


def pytest_collection_modifyitems(config, items):
    """In the portable mode, tests marked ``needs_internals("what")`` are skipped, saying what
    that mode lacks; keywords narrow it to some parameters (``transport="callback"``,
    ``ordered=True``: only the runs with those). Everything else runs."""
    if not _jax.PORTABLE:
        return
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for marker in item.iter_markers("needs_internals"):
            if all(params.get(name) == value for name, value in marker.kwargs.items()):
                item.add_marker(pytest.mark.skip(
                    reason=f"the portable mode ({_jax.PORTABLE_REASON}) lacks {marker.args[0]}"))
                break


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    """Runs a test once per transport; both must give the same behaviour."""
    with config.override(transport=request.param):
        yield request.param


@pytest.fixture
def collector(tap_records):
    """The tap_records fixture (hostcallback.testing) waits for every tap at teardown."""
    return Collector(tap_records)

