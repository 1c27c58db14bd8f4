"""``hostcallback.debug``: ``jax.debug``'s callback and print, and ``jax.effects_barrier``, on
hostcallback's taps, with JAX's signatures (defined in jax_callbacks.py beside ``pure_callback``
and ``io_callback``). Change ``jax.debug`` to ``hostcallback.debug`` and the code stays as it is.
"""

from hostcallback.jax_callbacks import HostArray, callback, effects_barrier, print  # noqa: A004

__all__ = ["HostArray", "callback", "effects_barrier", "print"]
