"""The knobs that say how JAX may treat a callback: its flavor, how `call` batches under vmap, and
what a tap does when jax.checkpoint recomputes it.

They mirror the old ``host_callback.CallbackFlavor`` and ``jax.pure_callback``'s ``vmap_method``,
so code written against those references keeps its meaning here ("Migrating to hostcallback").
"""

from __future__ import annotations

import enum


class CallbackFlavor(enum.Enum):
    """What JAX may do with a tap or call; "Taps and calls under JAX transformations" has a table.

    IO_CALLBACK (default): never removed, never duplicated, program order per device.
    PURE: like ``jax.pure_callback``: removed when its result is unused, may be recomputed.
    DEBUG: like ``jax.debug.callback``: never removed, returns nothing, the device never waits.
    """

    IO_CALLBACK = "io_callback"
    PURE = "pure"
    DEBUG = "debug"
    # The old outfeed-based flavor of host_callback: that is what hostcallback is.
    XLA_ONLY = "io_callback"  # noqa: PIE796 (an alias on purpose)


# The flavor as a tap's primitive carries it (its value).
PURE_FLAVOR = CallbackFlavor.PURE.value

# id_tap's ``replays``: what a tap does when jax.checkpoint recomputes it under grad.
REPLAYS = ("deliver", "mark", "skip")


def flavor_of(value: CallbackFlavor | str | None) -> CallbackFlavor:
    """Accepts the enum, its name or its value ("PURE", "pure"); None is the default."""
    if value is None:
        return CallbackFlavor.IO_CALLBACK
    if isinstance(value, CallbackFlavor):
        return value
    if isinstance(value, str):
        for candidate in (value, value.lower()):
            try:
                return CallbackFlavor(candidate)
            except ValueError:
                pass
        if value.upper() in CallbackFlavor.__members__:
            return CallbackFlavor[value.upper()]
    choices = ", ".join(f"CallbackFlavor.{name}" for name in ("IO_CALLBACK", "PURE", "DEBUG"))
    raise ValueError(f"callback_flavor must be one of {choices}, got {value!r}")


VMAP_METHODS = ("sequential", "sequential_unrolled", "expand_dims", "broadcast_all",
                "legacy_vectorized")


def check_vmap_method(vmap_method: str | None) -> str | None:
    if vmap_method is not None and vmap_method not in VMAP_METHODS:
        raise ValueError(
            f"vmap_method must be one of {', '.join(map(repr, VMAP_METHODS))} or None, got "
            f"{vmap_method!r}")
    return vmap_method
