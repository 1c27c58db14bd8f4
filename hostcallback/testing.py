"""Test helpers, registered as a pytest plugin (entry point ``hostcallback``).

Once a test has used hostcallback, the plugin waits after every test until its taps have been
handled (``barrier_wait``), so a consumer that raised fails the test whose tap it was, not a
later one. Turn that off with the ini option ``hostcallback_wait_after_each_test = false``; the
wait fails the test after ``hostcallback_wait_timeout`` seconds (120), and after a wait that timed
out or found a receiver dead the plugin stops waiting for the rest of the session.

The ``tap_records`` fixture hands out tap functions by name and collects what they receive::

    def test_loss_is_tapped(tap_records):
        step(params)                      # taps with hcb.id_tap(tap_records.tap("loss"), loss)
        hcb.barrier_wait()
        assert len(tap_records["loss"]) == 1

Every pytest run in an environment that has hostcallback installed loads this module, so it
imports nothing at load but pytest and the standard library: never jax, never the rest of
hostcallback (whose ``__init__`` must stay as cheap). The fixture imports hostcallback when a test
asks for it.
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
from typing import Any

import pytest

WAIT_OPTION = "hostcallback_wait_after_each_test"
TIMEOUT_OPTION = "hostcallback_wait_timeout"
JAX_CALLBACKS_OPTION = "hostcallback_jax_callbacks"


class TapRecords:
    """Tapped values by name, in arrival order; each entry is (value, transforms, device)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, list[tuple[Any, tuple, Any]]] = {}
        self._taps: dict[str, Any] = {}

    def tap(self, name: str):
        """The tap function that files what it receives under ``name`` (one per name)."""
        if name not in self._taps:
            def record(arg, transforms, device=None):
                with self._lock:
                    self._by_name.setdefault(name, []).append((arg, transforms, device))

            record.__name__ = f"tap_records[{name!r}]"
            self._taps[name] = record
        return self._taps[name]

    def __getitem__(self, name: str) -> list[Any]:
        """The values tapped under ``name``; KeyError for a name never handed out by tap()."""
        return [value for value, _, _ in self.entries(name)]

    def entries(self, name: str) -> list[tuple[Any, tuple, Any]]:
        with self._lock:
            if name not in self._taps and name not in self._by_name:
                known = ", ".join(repr(n) for n in sorted(self._taps)) or "none yet"
                raise KeyError(f"no tap function was handed out under {name!r} "
                               f"(tap_records.tap(name)); known names: {known}")
            return list(self._by_name.get(name, []))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def clear(self) -> None:
        with self._lock:
            self._by_name.clear()


@pytest.fixture
def tap_records():
    records = TapRecords()
    yield records
    _wait_for_taps()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(WAIT_OPTION, type="bool", default=True,
                  help="hostcallback: after every test that ran once hostcallback was used, wait "
                       "until its taps are handled and fail the test if a consumer raised")
    parser.addini(TIMEOUT_OPTION, default="120",
                  help="hostcallback: seconds that wait may take before it fails the test")
    parser.addini(JAX_CALLBACKS_OPTION, type="bool", default=False,
                  help="hostcallback: serve JAX's own callbacks (jax.debug.print and callback, "
                       "io_callback, pure_callback) on hostcallback's transport in the run")


def pytest_configure(config: pytest.Config) -> None:
    global _wait_timeout_s
    try:
        _wait_timeout_s = float(config.getini(TIMEOUT_OPTION))
    except ValueError:
        raise pytest.UsageError(f"{TIMEOUT_OPTION} must be a number of seconds, got "
                                f"{config.getini(TIMEOUT_OPTION)!r}") from None
    if config.getini(JAX_CALLBACKS_OPTION):
        from hostcallback.serving import serve_jax_callbacks

        serve_jax_callbacks()


def _pluggy_has_new_style_wrappers() -> bool:
    """``hookimpl(wrapper=True)`` needs pluggy 1.2; this module loads in every pytest run of an
    environment with hostcallback, so an older pluggy must not break the session."""
    try:
        major, minor = (int(part) for part in importlib.metadata.version("pluggy").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (1, 2)


if _pluggy_has_new_style_wrappers():
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item: pytest.Item):
        """After the test body: its taps are handled before the next test starts, and a
        consumer error fails this test (added as a note when the test failed on its own; a
        skipped or xfailed test keeps its outcome)."""
        try:
            result = yield
        except BaseException as outcome:
            if _should_wait(item) and not isinstance(outcome, KeyboardInterrupt):
                try:
                    _wait_for_taps()
                except pytest.fail.Exception as tap_failure:
                    if isinstance(outcome, Exception):
                        outcome.add_note(str(tap_failure))
            raise
        if _should_wait(item):
            _wait_for_taps()
        return result


def _should_wait(item: pytest.Item) -> bool:
    """Only once a test has used hostcallback's API, any of it (everything that taps or calls
    imports the lifecycle; a session that never does imports nothing), unless the ini option
    turns it off or an earlier wait gave up."""
    return ("hostcallback.lifecycle" in sys.modules and item.config.getini(WAIT_OPTION)
            and _gave_up is None)


# Why the plugin stopped waiting after tests, once a wait timed out or the receivers failed:
# every later test would wait and fail the same way.
_gave_up: str | None = None
_wait_timeout_s = 120.0


def _wait_for_taps() -> None:
    global _gave_up
    if _gave_up is not None:
        return
    import hostcallback
    from hostcallback._host.receiver import receivers

    try:
        hostcallback.barrier_wait(timeout=_wait_timeout_s)
    except hostcallback.CallbackException as error:
        if receivers.dead:
            _gave_up = f"a receiver failed: {error}"
            pytest.fail(f"hostcallback's receivers failed during the test: {error}; the plugin "
                        "no longer waits after tests in this session", pytrace=False)
        pytest.fail(f"a tap consumer raised during the test: {error}", pytrace=False)
    except TimeoutError:
        _gave_up = "a wait timed out"
        pytest.fail(f"the test's taps were not all handled within {_wait_timeout_s:g} s after "
                    "it ended (a consumer or call function still running?); the plugin no "
                    "longer waits after tests in this session", pytrace=False)
