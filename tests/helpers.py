"""What the tests share, written once: fresh interpreters and pytest runs, waiting for a condition,
what owns an array's memory, a free port, a queue of the C++ core of one's own, a two-process
cluster, and the tap function behind the ``collector`` fixture.

Every test imports these one way, ``from helpers import ...``: tests/ is on ``sys.path`` because
tests/conftest.py lives there (pytest's default prepend import mode), so the test folders need no
``__init__.py``. No test keeps a copy of a helper here; fixtures, hooks and markers stay in
conftest.py. Nothing here may import a test module, and hostcallback's modules are imported inside
the helpers that use them: conftest.py imports this module before any test, and a session must
import only what its tests import.
"""

import itertools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: docs/, examples/, pyproject.toml
TRANSPORTS = ("native", "callback")

# A platform no receiver drains: a test that enqueues there owns its queue and reads it itself.
TEST_PLATFORM = "test"
_next_device = itertools.count(100)  # ids no real device has, so ("cpu", id) is another queue


def run_python(code: str, *, devices: int = 4, env: dict | None = None, timeout: float = 240,
               cwd=None) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (for exit and stop behaviour, and the docs' samples)
    in ``cwd`` (default: this one); returns the process."""
    full_env = dict(os.environ)
    full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full_env["JAX_PLATFORMS"] = "cpu"
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False,
                          capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=cwd)


def run_pytest(project, *args: str) -> subprocess.CompletedProcess:
    """``python -m pytest`` in ``project`` in a fresh process, plugins autoloaded (as a user's run
    loads ours, from the installed entry point) whatever our own run was told."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=240, cwd=project,
                          env=environment, check=False)


def memory_owner(array):
    """The object at the end of a numpy array's chain of bases: the array that owns its memory,
    or what else keeps that memory (a record's owner, for an array decoded from a record)."""
    import numpy as np

    while isinstance(array.base, np.ndarray):
        array = array.base
    return array if array.base is None else array.base


def wait_until(predicate, timeout: float = 20.0, what: str = "the condition") -> None:
    """Polls ``predicate`` until it holds; fails the test, naming ``what``, if it does not within
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)


def free_port() -> int:
    """A loopback port where nothing listens: free to listen on, or to find no one at."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fresh_queue() -> int:
    """A device id of TEST_PLATFORM that no other test uses: its queue is this test's alone."""
    return next(_next_device)


def drain_one(device: int):
    """The one record waiting in a TEST_PLATFORM queue (waits up to 5 s for it), as raw bytes."""
    from hostcallback._native import outfeed

    (raw,) = outfeed.drain_raw(device, 1, 1 << 30, 5.0, platform=TEST_PLATFORM)
    return raw


def run_jax_processes(worker: Path, *args: str, transport: str) -> list[str]:
    """Runs ``worker COORDINATOR_PORT PROCESS_ID *args`` as two jax.distributed processes of 2
    CPU devices each, to the end; returns their outputs (stdout and stderr), both having
    succeeded."""
    # PYTHONFAULTHANDLER: a worker stopped with SIGABRT prints the stack of each of its threads.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               HOSTCALLBACK_TRANSPORT=transport, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    coordinator = free_port()
    workers = [subprocess.Popen(
        [sys.executable, str(worker), str(coordinator), str(process), *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for process in range(2)]
    deadline = time.monotonic() + 200  # all of them, leaving the stacks time within 300 s
    try:
        outputs = [w.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
                   for w in workers]
    except subprocess.TimeoutExpired:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGABRT)
        outputs = [w.communicate(timeout=30)[0] for w in workers]
        raise AssertionError("the workers did not finish within 200 s; their output, with "
                             "the stacks of those stopped:\n" + "\n".join(outputs)) from None
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
    return outputs


def run_cluster(tmp_path, worker: Path, steps: int, transport: str, run: str,
                expected_records: int) -> list:
    """Runs ``worker`` as two jax.distributed processes of 2 CPU devices each, streaming to one
    collector, to the end; returns the records of ``run`` the collector wrote."""
    from hostcallback.consumer import read_records
    from hostcallback.consumer.collector import CollectorThread

    server = CollectorThread(tmp_path / "collected").start()
    try:
        run_jax_processes(worker, str(server.port), str(steps), transport=transport)
        deadline = time.monotonic() + 10
        while server.collector.records_written < expected_records and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(read_records(server.collector.path_for(run)))
    finally:
        server.stop()


class Collector:
    """One tap function whose calls the plugin's ``tap_records`` fixture keeps, with the device
    (the ``collector`` fixture of conftest.py)."""

    def __init__(self, tap_records, name="collected"):
        self._records, self._name = tap_records, name
        self._tap = tap_records.tap(name)
        self.__name__ = name

    def __call__(self, arg, transforms, device=None):
        self._tap(arg, transforms, device)

    @property
    def calls(self):
        return self._records.entries(self._name)

    @property
    def values(self):
        return self._records[self._name]

    def clear(self):
        self._records.clear()
