"""Settings of hostcallback: each from a keyword, else a ``HOSTCALLBACK_*`` variable, else a
default.

This module only holds values; it never starts threads or touches devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

TRANSPORTS = ("native", "callback")
# "handled": a computation's results are ready once its taps have been handled (the default, as
# JAX's own callbacks); "dispatch": also the call that dispatches it returns only then (as JAX's
# callbacks on CPU); "async": results are ready as soon as the device is done, taps follow.
DELIVERIES = ("handled", "dispatch", "async")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: use 1/true/yes/on or 0/false/no/off")


def _env_delivery() -> str:
    raw = os.environ.get("HOSTCALLBACK_DELIVERY", "").strip().lower()
    if raw == "":
        return "handled"
    if raw not in DELIVERIES:
        raise ValueError(f"HOSTCALLBACK_DELIVERY={raw!r}: choose one of {', '.join(DELIVERIES)}")
    return raw


def _env_transport() -> str | None:
    raw = os.environ.get("HOSTCALLBACK_TRANSPORT", "").strip().lower()
    if raw == "":
        return None
    if raw not in TRANSPORTS:
        raise ValueError(f"HOSTCALLBACK_TRANSPORT={raw!r}: choose one of {', '.join(TRANSPORTS)}")
    return raw


@dataclasses.dataclass
class Settings:
    """What the tap service reads at trace, lowering and receive time."""

    # None: native wherever a native handler exists, the callback transport elsewhere.
    transport: str | None = dataclasses.field(default_factory=_env_transport)
    # Default of the taps' ``ordered`` keyword: strict program order across loops, branches and
    # calls, at the price of JAX's slower dispatch for computations that hold such taps.
    ordered: bool = dataclasses.field(
        default_factory=lambda: env_bool("HOSTCALLBACK_ORDERED", False))
    # When a computation's results are ready: once its taps were handled, or at once ("async").
    delivery: str = dataclasses.field(default_factory=_env_delivery)
    # Byte budget of each device's outfeed queue; a full queue makes the device wait.
    max_queue_bytes: int = dataclasses.field(
        default_factory=lambda: _env_int("HOSTCALLBACK_MAX_QUEUE_BYTES", 256 << 20))
    # How long interpreter exit waits for pending taps before giving up with a warning.
    exit_timeout_s: float = dataclasses.field(
        default_factory=lambda: _env_float("HOSTCALLBACK_EXIT_TIMEOUT", 60.0))
    # JAX's own callbacks (jax.debug.callback and print, io_callback, pure_callback) served on
    # hostcallback's transport in computations lowered from now on (serve_jax_callbacks).
    jax_callbacks: bool = dataclasses.field(
        default_factory=lambda: env_bool("HOSTCALLBACK_JAX_CALLBACKS", False))


settings = Settings()

# Work for the next lowering of a computation, when hostcallback's modules are all imported:
# turning the switch on for HOSTCALLBACK_JAX_CALLBACKS where jax was first imported by
# hostcallback itself, half-way through its own imports (_startup.py).
at_next_lowering: list = []


def configure(*, transport: str | None = None, ordered: bool | None = None,
              max_queue_bytes: int | None = None, exit_timeout_s: float | None = None,
              delivery: str | None = None) -> None:
    """Changes settings for taps traced from now on (the queue budget applies at once; a
    delivery applies to computations compiled from now on). An argument left None keeps its
    setting.

    ``transport``: "native" (the C++ handler where the platform has one, JAX's callbacks
    elsewhere) or "callback" (JAX's callbacks everywhere); ``HOSTCALLBACK_TRANSPORT``.
    ``ordered``: the default of the taps' ``ordered`` keyword; ``HOSTCALLBACK_ORDERED``.
    ``max_queue_bytes``: each device's queue budget in bytes, beyond which a device waits;
    ``HOSTCALLBACK_MAX_QUEUE_BYTES`` (256 MiB). ``exit_timeout_s``: how long interpreter exit
    waits for pending taps; ``HOSTCALLBACK_EXIT_TIMEOUT`` (60). ``delivery``: when results are
    ready: "handled" (once the computation's taps were handled, the default), "dispatch" (also
    dispatch waits for them, as JAX's own callbacks make it on CPU) or "async" (at once);
    ``HOSTCALLBACK_DELIVERY``."""
    if delivery is not None:
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery={delivery!r}: choose one of {', '.join(DELIVERIES)}")
        settings.delivery = delivery
    if ordered is not None:
        settings.ordered = bool(ordered)
    if transport is not None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: choose one of {', '.join(TRANSPORTS)}")
        settings.transport = transport
    if max_queue_bytes is not None:
        if max_queue_bytes <= 0:
            raise ValueError(f"max_queue_bytes={max_queue_bytes} must be positive")
        settings.max_queue_bytes = max_queue_bytes
        from hostcallback import _native  # late: applying the budget needs the extension

        _native.outfeed.set_max_queue_bytes(max_queue_bytes)
    if exit_timeout_s is not None:
        settings.exit_timeout_s = exit_timeout_s


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Temporarily changes settings (tests use it to run one behaviour on both transports)."""
    before = dataclasses.replace(settings)
    configure(**changes)
    try:
        yield settings
    finally:
        configure(transport=before.transport or None, ordered=before.ordered,
                  max_queue_bytes=before.max_queue_bytes, exit_timeout_s=before.exit_timeout_s,
                  delivery=before.delivery)
        settings.transport = before.transport
