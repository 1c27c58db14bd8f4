"""The functions with JAX's signatures, on hostcallback's taps: ``jax.debug.callback``,
``jax.debug.print`` and ``jax.effects_barrier`` (public as ``hostcallback.debug``), and
``jax.pure_callback`` and ``jax.experimental.io_callback`` (public as ``hostcallback.pure_callback``
and ``hostcallback.io_callback``).

Change ``jax.debug`` to ``hostcallback.debug`` and the code stays as it is. ``debug.callback``
and ``debug.print`` bind JAX's own ``jax.debug.callback``, so JAX's rules transform them and
JAX's semantics hold, marked (``OnHost``) so that hostcallback serves them where it is native
(served_callbacks.py): the callback runs on the device's receiver thread, after the device went
on, with jax.Arrays on the CPU as JAX's does, instead of on the device's own thread while it
waits (the migration guide says what differs). ``hostcallback.id_tap`` hands read-only numpy
views instead, for a quarter of the host's work.
``effects_barrier()`` waits for them as ``jax.effects_barrier()`` waits for JAX's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from hostcallback import _jax as jx
from hostcallback._host import reentry
from hostcallback._host.printing import HostArray, Printer, has_fields
from hostcallback.errors import name_of
from hostcallback.flavors import CallbackFlavor
from hostcallback.lifecycle import lifecycle
from hostcallback.tapping import (
    CallWithArgs,
    FormatCheck,
    OnHost,
    bind_call,
    check_arity,
)

if not jx.PORTABLE:  # serves what OnHost marks (the portable mode leaves them to JAX)
    from hostcallback import served_callbacks  # noqa: F401

# JAX's own, as they are now: a program may put ours in their place (jax.debug.callback = ...).
_jax_debug_callback = jax.debug.callback
_jax_effects_barrier = getattr(jax.effects_barrier, "hostcallback_wraps", jax.effects_barrier)

__all__ = ["HostArray", "callback", "effects_barrier", "io_callback", "print", "pure_callback"]


def callback(callback: Callable[..., None] | None = None, *args: Any, ordered: bool = False,
             partitioned: bool = False, **kwargs: Any) -> Callable[..., None] | None:
    """Calls ``callback(*args, **kwargs)`` on the host, as ``jax.debug.callback`` does.

    The two-call form ``callback(ordered=True)(f, x)`` works too. Leaves that are not arrays or
    numbers (strings, objects) reach the callback as they are; arrays arrive as ``jax.Array``s
    on the CPU, as with ``jax.debug.callback``. Its return value is ignored. ``ordered=True``
    keeps the order across computations, as JAX's does; ``partitioned=True`` calls once per
    shard in a sharded jit, with that device's shard (without it: once, with the whole value).
    """
    if callback is None:
        if args or kwargs:
            raise TypeError("debug_callback received unexpected arguments in the two-call form:"
                            f" {args=} {kwargs=}")

        def with_options(callback: Callable[..., None], *args: Any, **kwargs: Any) -> None:
            _debug_callback(callback, args, kwargs, ordered, partitioned)

        return with_options
    _debug_callback(callback, args, kwargs, ordered, partitioned)
    return None


def print(fmt: str | None = None, *args: Any, ordered: bool = False,  # noqa: A001 - JAX's name
          partitioned: bool = False, skip_format_check: bool = False,
          **kwargs: Any) -> Callable[..., None] | None:
    """Prints ``fmt.format(*args, **kwargs)`` from the host, as ``jax.debug.print`` does.

    Arrays are formatted with the numpy print options in force where it was traced; a format
    string without fields prints itself followed by the values, separated by spaces. The
    two-call form ``print(ordered=True)("x={x}", x=x)`` works too. ``ordered`` and
    ``partitioned`` mean what they mean for ``callback``; ``skip_format_check=True`` leaves out
    the check, at trace time, that the format string's fields match the arguments.
    """
    if fmt is None:
        if args or kwargs:
            raise TypeError("debug_print received unexpected arguments in the two-call form:"
                            f" {args=} {kwargs=}")

        def with_options(fmt: str, *args: Any, **kwargs: Any) -> None:
            _debug_print(fmt, args, kwargs, ordered, partitioned, skip_format_check)

        return with_options
    _debug_print(fmt, args, kwargs, ordered, partitioned, skip_format_check)
    return None


def effects_barrier() -> None:
    """Waits until every callback and print dispatched so far has run, as
    ``jax.effects_barrier()`` does for JAX's own (those JAX lowers itself: in the portable mode,
    or where hostcallback is not native); a callback that raised where its computation went on
    is raised here as CallbackException (before what JAX's wait raised, which may be the same
    failure as the computation saw it)."""
    try:
        _jax_effects_barrier()
    except jax.errors.JaxRuntimeError as error:
        lifecycle.barrier_wait()
        raise error
    lifecycle.barrier_wait()


def _debug_callback(callback: Callable[..., None], args: tuple, kwargs: dict, ordered: bool,
                    partitioned: bool) -> None:
    if not callable(callback):
        raise TypeError("first argument to jax.debug.callback must be callable, but got an "
                        f"object of type {type(callback)}")
    _through_jax(CallWithArgs(callback), args, kwargs, ordered, partitioned,
                 name=name_of(callback))


def _debug_print(fmt: str, args: tuple, kwargs: dict, ordered: bool, partitioned: bool,
                 skip_format_check: bool) -> None:
    if not skip_format_check:
        FormatCheck("jax.debug.print", jax_rules=True).check(fmt, args, kwargs)
    printer = Printer(fmt, print_options=tuple(np.get_printoptions().items()),
                      jax_formats=has_fields(fmt))
    _through_jax(printer, args, kwargs, ordered, partitioned, name="debug.print")


def _through_jax(target: Any, args: tuple, kwargs: dict, ordered: bool, partitioned: bool,
                 name: str) -> None:
    """``target.apply(args, kwargs)`` as a ``jax.debug.callback`` of JAX's own, which JAX's rules
    transform, marked (OnHost) so that its equations are served by hostcallback."""
    reentry.refuse_inside_consumer("a debug callback")
    _jax_debug_callback(OnHost(target, name), args, kwargs, ordered=bool(ordered),
                        partitioned=bool(partitioned))


def _checked_callback(api: str, callback: Any, sharding: Any, args: tuple,
                      kwargs: dict) -> CallWithArgs:
    """pure_callback's and io_callback's arguments, checked at trace time; the callback as a
    call consumer takes it."""
    if sharding is not None and len(getattr(sharding, "device_set", ())) != 1:
        raise NotImplementedError(
            f"{api}(sharding={sharding!r}): only None or a single-device sharding is "
            "supported; to pick which device of a sharded computation calls the host, use "
            "hostcallback.call(..., device_index=i)")
    if not callable(callback):
        raise TypeError(f"{api}() needs a callable, got {type(callback).__name__}")
    check_arity(callback, api, len(args), False,
                f"callback(*args, **kwargs) with {len(args)} argument(s)"
                + (f" and keyword(s) {', '.join(sorted(kwargs))}" if kwargs else ""),
                "a function that takes the arguments given after result_shape_dtypes",
                keywords=tuple(kwargs))
    return CallWithArgs(callback, as_jax_arrays=not jx.is_tracing())


def pure_callback(callback: Callable[..., Any], result_shape_dtypes: Any, *args: Any,
                  sharding: Any = None, vmap_method: str | None = None, **kwargs: Any) -> Any:
    """``jax.pure_callback`` with the same signature, over hostcallback's transport.

    ``callback(*args, **kwargs)`` runs on the host with numpy arrays and returns a pytree like
    ``result_shape_dtypes``. JAX may drop the call when its result is unused
    (CallbackFlavor.PURE). Unlike JAX's, it runs per device under pmap and shard_map, and an
    error in it fails the computation with a message that names it and reaches barrier_wait.
    ``sharding`` may only be None or a single-device sharding of the device that runs the
    computation; hostcallback.call's ``device_index`` picks a device of a sharded computation.
    ``vmap_method`` has jax.pure_callback's meanings.
    """
    return bind_call(_checked_callback("pure_callback", callback, sharding, args, kwargs),
                     (args, kwargs), result_shape=result_shape_dtypes,
                     callback_flavor=CallbackFlavor.PURE, vmap_method=vmap_method,
                     jax_api="pure_callback")


def io_callback(callback: Callable[..., Any], result_shape_dtypes: Any, *args: Any,
                sharding: Any = None, ordered: bool = False, **kwargs: Any) -> Any:
    """``jax.experimental.io_callback`` with the same signature, over hostcallback's transport.

    ``callback(*args, **kwargs)`` runs on the host and returns a pytree like
    ``result_shape_dtypes``, which comes back into the computation; it is never dropped or
    repeated. ``ordered=True`` keeps program order with other ordered callbacks across
    computations. Under vmap it runs once per batch element (an ordered one cannot be vmapped);
    under grad it raises, as JAX's does. ``sharding``: as for pure_callback.
    """
    return bind_call(_checked_callback("io_callback", callback, sharding, args, kwargs),
                     (args, kwargs), result_shape=result_shape_dtypes, ordered=bool(ordered),
                     callback_flavor=CallbackFlavor.IO_CALLBACK,
                     vmap_method=None if ordered else "sequential", jax_api="io_callback")
