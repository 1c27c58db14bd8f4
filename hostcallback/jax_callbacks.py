"""The functions with JAX's signatures, on hostcallback's taps: ``jax.debug.callback``,
``jax.debug.print`` and ``jax.effects_barrier`` (public as ``hostcallback.debug``), and
``jax.pure_callback`` and ``jax.experimental.io_callback`` (public as ``hostcallback.pure_callback``
and ``hostcallback.io_callback``).

Change ``jax.debug`` to ``hostcallback.debug`` and the code stays as it is: the same arguments,
the same calls of the callback (once per batch element under vmap, primal values only under
jvp and grad, each device's shard with ``partitioned=True``), the same printed text. What
differs is where the callback runs: on the device's receiver thread, after the device went on,
instead of on the device's own thread while it waits (the migration guide says what differs).
``effects_barrier()`` waits for them as ``jax.effects_barrier()`` waits for JAX's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax import tree_util

from hostcallback import _jax as jx
from hostcallback._host.printing import HostArray, Printer, has_fields
from hostcallback._records.registry import DEBUG_CALLBACK_API, Consumer, EqualByKey
from hostcallback.flavors import CallbackFlavor
from hostcallback.lifecycle import lifecycle
from hostcallback.tapping import (
    CallWithArgs,
    FormatCheck,
    bind_call,
    bind_tap,
    check_arity,
    flatten,
    tap_only_params,
)

__all__ = ["HostArray", "callback", "effects_barrier", "io_callback", "print", "pure_callback"]


def callback(callback: Callable[..., None] | None = None, *args: Any, ordered: bool = False,
             partitioned: bool = False, **kwargs: Any) -> Callable[..., None] | None:
    """Calls ``callback(*args, **kwargs)`` on the host, as ``jax.debug.callback`` does.

    The two-call form ``callback(ordered=True)(f, x)`` works too. Leaves that are not arrays or
    numbers (strings, objects) reach the callback as they are; arrays arrive as ``HostArray``:
    read-only numpy arrays that print and format as ``jax.Array`` does. Its return value is
    ignored. ``ordered=True`` keeps the order across computations, as JAX's does;
    ``partitioned=True`` calls once per shard in a sharded jit, with that device's shard
    (without it: once, with the whole value).
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
    ``jax.effects_barrier()`` does for JAX's own; a callback that raised is raised here as
    CallbackException. (``barrier_wait()`` does the same; JAX's own callbacks need
    ``jax.effects_barrier()``.)"""
    lifecycle.barrier_wait()


def _debug_callback(callback: Callable[..., None], args: tuple, kwargs: dict, ordered: bool,
                    partitioned: bool) -> None:
    if not callable(callback):
        raise TypeError("first argument to jax.debug.callback must be callable, but got an "
                        f"object of type {type(callback)}")
    _tap_arguments(_Unbatching(CallWithArgs(callback)), args, kwargs, ordered, partitioned,
                   name=getattr(callback, "__name__", "debug.callback"))


def _debug_print(fmt: str, args: tuple, kwargs: dict, ordered: bool, partitioned: bool,
                 skip_format_check: bool) -> None:
    if not skip_format_check:
        FormatCheck("jax.debug.print", jax_rules=True).check(fmt, args, kwargs)
    printer = Printer(fmt, print_options=tuple(np.get_printoptions().items()),
                      jax_formats=has_fields(fmt))
    _tap_arguments(_Unbatching(printer), args, kwargs, ordered, partitioned, name="debug.print")


def _tap_arguments(function: _Unbatching, args: tuple, kwargs: dict, ordered: bool,
                   partitioned: bool, name: str) -> None:
    """Taps the arguments' array leaves; the others travel with the consumer, as JAX keeps
    them out of the computation."""
    leaves, in_tree = tree_util.tree_flatten((args, kwargs))
    static = {i: leaf for i, leaf in enumerate(leaves) if not _is_array_like(leaf)}
    dynamic = [leaf for i, leaf in enumerate(leaves) if i not in static]
    flat, treedef, key_impls = flatten(tuple(dynamic))
    # Key arrays travel as their key data and become keys again per batch element.
    function.bind_layout(in_tree, static, key_impls)
    consumer = Consumer(func=function, treedef=treedef, name=name, jax_api=DEBUG_CALLBACK_API)
    bind_tap(consumer, flat, 0, bool(ordered), CallbackFlavor.DEBUG,
             **tap_only_params(partitioned, "deliver"))


def _is_array_like(leaf: Any) -> bool:
    """What JAX stages as an operand: anything it can give an abstract value."""
    try:
        jax.typeof(leaf)
    except (TypeError, AssertionError):
        return False
    return True


class _Unbatching(EqualByKey):
    """A tap function that hands ``target.apply(args, kwargs)`` each element of every batch the
    values carry (vmap), in JAX's order, with the static leaves put back in place; the target is
    the callback (CallWithArgs) or the printer."""

    __slots__ = ("in_tree", "key_impls", "static", "target")

    def __init__(self, target: CallWithArgs | Printer) -> None:
        self.target = target

    def bind_layout(self, in_tree, static: dict[int, Any], key_impls: tuple) -> None:
        self.in_tree, self.static, self.key_impls = in_tree, static, key_impls

    def _key(self) -> tuple:
        static = tuple((i, _hashable_or_id(v)) for i, v in self.static.items())
        return (self.target, self.in_tree, static, self.key_impls)

    def __call__(self, dynamic: tuple, transforms: tuple) -> None:
        batches = [params["batch_dims"] for name, params in transforms if name == "batch"]
        impls = self.key_impls or (None,) * len(dynamic)
        for element in _unbatched(list(dynamic), batches):
            merged, values = [], iter(map(_shown, element, impls))
            for i in range(self.in_tree.num_leaves):
                merged.append(self.static[i] if i in self.static else next(values))
            args, kwargs = tree_util.tree_unflatten(self.in_tree, merged)
            self.target.apply(args, kwargs)


def _shown(leaf: np.ndarray, key_impl: str | None) -> Any:
    """A tapped leaf as the callback gets it: a HostArray, or a key array again."""
    if key_impl is not None:
        return jax.random.wrap_key_data(np.ascontiguousarray(leaf), impl=key_impl)
    return leaf.view(HostArray)


def _unbatched(leaves: list, batches: list[tuple]) -> Iterator[list]:
    """Each batch element's leaves, in the order JAX's debug callbacks are called under nested
    vmaps: ``batches`` lists each vmap's batch axis per leaf (None: not batched), the innermost
    vmap first; its elements are the outermost loop, the outermost vmap's the innermost."""
    if not batches:
        yield leaves
        return
    *inner, outer = batches
    size = next((leaf.shape[d] for leaf, d in zip(leaves, outer) if d is not None), 1)
    per_element = [list(_unbatched([leaf if d is None else leaf[(slice(None),) * d + (i, ...)]
                                    for leaf, d in zip(leaves, outer)], inner))
                   for i in range(size)]
    for k in range(len(per_element[0]) if per_element else 0):
        for element in per_element:
            yield element[k]


def _hashable_or_id(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


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
