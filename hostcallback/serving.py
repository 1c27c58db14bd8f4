"""One switch that serves JAX's own callbacks on hostcallback's transport, for code that calls
``jax.debug.print``, ``jax.debug.callback``, ``jax.experimental.io_callback`` or
``jax.pure_callback`` directly (its own or a library's) and cannot change an import.

``serve_jax_callbacks()`` turns it on for every computation lowered from then on (a function
already compiled keeps what it was compiled with); ``serve_jax_callbacks(False)`` gives the
next lowerings back to JAX. ``HOSTCALLBACK_JAX_CALLBACKS=1`` turns it on at interpreter start
for programs one cannot edit, and the pytest option ``hostcallback_jax_callbacks = true`` for a
test run. Only the lowering changes: JAX's batching, JVP, transpose, remat and DCE rules stay in
force. The callbacks then run on the devices' receiver threads, as taps do, and
``jax.effects_barrier()`` also waits for them. On a platform without our native handler, JAX's
own lowering stays.
"""

from __future__ import annotations

from hostcallback import _jax, config

__all__ = ["serve_jax_callbacks", "serving_jax_callbacks"]


_installed = False  # the rewrite and the effects_barrier wrapper are in place


def serve_jax_callbacks(enabled: bool = True) -> None:
    """Serves JAX's own callbacks on hostcallback's transport in computations lowered from now
    on (``enabled=False``: JAX's own lowering again, from now on)."""
    if enabled:
        _install()
    config.settings.jax_callbacks = bool(enabled)


def serving_jax_callbacks() -> bool:
    """Whether computations lowered now have JAX's callbacks served by hostcallback."""
    return config.settings.jax_callbacks and _installed


def _install() -> None:
    if _jax.PORTABLE:
        raise RuntimeError(
            "serve_jax_callbacks() needs hostcallback's own lowering, which its portable mode "
            f"({_jax.PORTABLE_REASON}) does not have; JAX's callbacks keep JAX's lowering. "
            "Taps (hostcallback.id_tap, id_print) and hostcallback's io_callback and "
            "pure_callback run on hostcallback's transport there.")
    from hostcallback import served_callbacks  # noqa: F401 - adds its rewrite
    from hostcallback._jax import patches

    # Also once the switch is off again: callbacks served before still run on our receivers.
    patches.add_to_effects_barrier(_wait_for_served_callbacks)
    global _installed
    _installed = True


def _wait_for_served_callbacks() -> None:
    """What jax.effects_barrier() adds: a barrier, except where JAX's own would not refuse and
    ours would (inside a callback, on its receiver thread; while tracing)."""
    from hostcallback._host.record_context import current_record
    from hostcallback.lifecycle import lifecycle

    if current_record() is None and not _jax.is_tracing():
        lifecycle.barrier_wait()
