"""Test helpers, registered as a pytest plugin (entry point ``hostcallback``).

The ``tap_records`` fixture hands out tap functions by name and collects what they receive; at
teardown it calls ``barrier_wait()``, so every tap of the test has arrived, and a consumer that
raised fails the test instead of leaking into the next one::

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

import threading
from typing import Any

import pytest


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
        """The values tapped under ``name``."""
        with self._lock:
            return [value for value, _, _ in self._by_name.get(name, [])]

    def entries(self, name: str) -> list[tuple[Any, tuple, Any]]:
        with self._lock:
            return list(self._by_name.get(name, []))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def clear(self) -> None:
        with self._lock:
            self._by_name.clear()


@pytest.fixture
def tap_records():
    import hostcallback  # here, not at module level: see the module docstring

    records = TapRecords()
    yield records
    try:
        hostcallback.barrier_wait(timeout=120)
    except hostcallback.CallbackException as error:
        pytest.fail(f"a tap consumer raised during the test: {error}", pytrace=False)
