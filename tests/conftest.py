"""Test set-up: four CPU devices for every test, both transports for behaviour tests."""

import os
import subprocess
import sys
import textwrap
import threading

# Must happen before jax is imported anywhere in the test process.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import pytest  # noqa: E402

import hostcallback  # noqa: E402
from hostcallback import config  # noqa: E402

TRANSPORTS = ("native", "callback")


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    """Runs a test once per transport; both must give the same behaviour."""
    with config.override(transport=request.param):
        yield request.param


class Collector:
    """A tap function that remembers every call: (arg, transforms, device)."""

    def __init__(self):
        self.calls = []
        self._lock = threading.Lock()

    def __call__(self, arg, transforms, device=None):
        with self._lock:
            self.calls.append((arg, transforms, device))

    @property
    def values(self):
        return [arg for arg, _, _ in self.calls]


@pytest.fixture
def collector():
    collected = Collector()
    yield collected
    hostcallback.barrier_wait(timeout=60)


def run_python(code: str, *, devices: int = 4, env: dict | None = None, timeout: float = 240):
    """Runs code in a fresh interpreter (for exit and stop behaviour); returns the process."""
    full_env = dict(os.environ)
    full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
