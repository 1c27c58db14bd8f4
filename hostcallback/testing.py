"""Test helpers, registered as a pytest plugin (entry point ``hostcallback``).

Once a test has used hostcallback, the plugin waits after every test until its taps have been
handled (``barrier_wait``), so a consumer that raised fails the test whose tap it was, not a
later one. Turn that off with the ini option ``hostcallback_wait_after_each_test = false``.

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

import sys
import threading
from typing import Any

import pytest

WAIT_OPTION = "hostcallback_wait_after_each_test"
WAIT_TIMEOUT_S = 120.0


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """After the test body: its taps are handled before the next test starts, and a consumer
    error fails this test (added as a note when the test failed on its own)."""
    try:
        result = yield
    except BaseException as failure:
        if _should_wait(item) and isinstance(failure, Exception):
            try:
                _wait_for_taps()
            except pytest.fail.Exception as tap_failure:
                failure.add_note(str(tap_failure))
        raise
    if _should_wait(item):
        _wait_for_taps()
    return result


def _should_wait(item: pytest.Item) -> bool:
    """Only once a test has used hostcallback's API (so a session that never does imports
    nothing), and unless the ini option turns it off."""
    return "hostcallback.api" in sys.modules and item.config.getini(WAIT_OPTION)


def _wait_for_taps() -> None:
    import hostcallback

    try:
        hostcallback.barrier_wait(timeout=WAIT_TIMEOUT_S)
    except hostcallback.CallbackException as error:
        pytest.fail(f"a tap consumer raised during the test: {error}", pytrace=False)
    except TimeoutError:
        pytest.fail(f"the test's taps were not all handled within {WAIT_TIMEOUT_S:.0f} s after "
                    "it ended (a consumer or call function still running?)", pytrace=False)
