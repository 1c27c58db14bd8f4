"""What binds a tap or a call into a computation: the ``outside_call`` primitive over JAX's
internals, or the portable mode's public-API taps (see ``hostcallback._jax``). Both take the same
arguments; the rest of the package binds through here and never picks one itself."""

from __future__ import annotations

from hostcallback import _jax

if _jax.PORTABLE:
    from hostcallback._trace.portable import bind
else:
    from hostcallback._trace.primitive import bind

__all__ = ["bind"]
