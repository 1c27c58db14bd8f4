"""The JAX versions hostcallback supports and has tested, read without importing JAX."""

from __future__ import annotations

import re

OLDEST_SUPPORTED = (0, 8, 0)
NEWEST_TESTED = (0, 12)  # the newest minor release that .ci/compat runs
SUPPORTED_TEXT = "jax 0.8 to 0.12 (tested: 0.8.0, 0.8.3, 0.9.2, 0.10.2, 0.11.2, 0.12.0.1)"


def version_tuple(text: str) -> tuple[int, ...]:
    """(0, 12, 0, 1) for "0.12.0.1"; a pre-release suffix ("0.13.0.dev20261101", "0.9.2rc1") ends
    it."""
    parts = []
    for piece in text.split("."):
        digits = re.match(r"\d*", piece).group()
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def refuse_unsupported(jax_version: str) -> None:
    """ImportError, naming the supported versions, for a JAX older than the oldest supported."""
    if version_tuple(jax_version) < OLDEST_SUPPORTED:
        raise ImportError(f"hostcallback supports {SUPPORTED_TEXT}; this is jax {jax_version}. "
                          "Upgrade JAX: pip install -U jax")


def is_untested(jax_version: str) -> bool:
    """Whether the version is newer than the newest one tested (it still works where it can)."""
    return version_tuple(jax_version)[:2] > NEWEST_TESTED
