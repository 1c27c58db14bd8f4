"""Building a tap or call from what a user passed, for the legacy API (api.py) and the functions
with JAX's signatures (jax_callbacks.py) alike: flattening the value (arrays and numbers; PRNG
keys travel as their key data), checking the options, the function's arity and a format string's
fields at trace time, adapting ``callback(*args, **kwargs)`` to a consumer, and binding it, once
the receivers run.

Every mistake answered here is answered at trace time with an error that names the argument and
says what to do instead.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable
from itertools import repeat
from typing import Any

import jax
import numpy as np
from jax import tree_util

from hostcallback import _jax as jx
from hostcallback import config
from hostcallback._host import reentry
from hostcallback._native import outfeed
from hostcallback._records import wire
from hostcallback._records.registry import Consumer, EqualByKey, registry
from hostcallback._trace import binding, transport
from hostcallback.errors import UnsupportedDtypeError, name_of
from hostcallback.flavors import REPLAYS, CallbackFlavor, check_vmap_method, flavor_of
from hostcallback.lifecycle import lifecycle

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _leaf_to_array(path, leaf):
    where = tree_util.keystr(path) or "the argument"
    if not isinstance(leaf, _ARRAY_TYPES):
        raise TypeError(
            f"hostcallback can only tap arrays and numbers, but {where} is of type "
            f"{type(leaf).__name__} ({leaf!r:.60}). Pass it through functools.partial to the tap "
            "function, or leave it out of the tapped value.")
    # device_put, not jnp.asarray: for numpy values and Python numbers outside a trace,
    # jnp.asarray compiles a computation of its own (an eager call would compile two).
    array = leaf if isinstance(leaf, jax.Array) else jax.device_put(leaf)
    try:
        wire.dtype_code(array.dtype)
    except UnsupportedDtypeError as error:
        raise TypeError(f"{where}: {error}") from None
    if array.ndim > wire.MAX_NDIM:
        raise ValueError(
            f"{where} has {array.ndim} dimensions; a tapped array can have at most "
            f"{wire.MAX_NDIM} (numpy's limit on the host). Reshape it before tapping.")
    return array


def refuse_pure_when_unused(flavor: CallbackFlavor, api: str, why: str) -> None:
    """A PURE tap is dropped when its outputs are unused; where they never are, it never runs."""
    if flavor is CallbackFlavor.PURE:
        raise ValueError(
            f"{api} with callback_flavor=PURE would never run: {why}, and JAX drops a PURE "
            "callback whose outputs are unused. Use the default flavor (IO_CALLBACK), or DEBUG.")


def bind_tap(consumer: Consumer, leaves, device_index: int, ordered: bool | None,
             flavor: CallbackFlavor, **call_params):
    if not isinstance(device_index, int) or device_index < 0:
        raise ValueError(f"device_index must be a non-negative int, got {device_index!r}")
    ordered = config.settings.ordered if ordered is None else bool(ordered)
    if ordered and call_params.get("partitioned"):
        raise ValueError(
            "partitioned=True taps cannot also be ordered=True (HOSTCALLBACK_ORDERED=1 sets it "
            "by default): each shard's tap runs in its own per-device computation. Pass "
            "ordered=False.")
    reentry.refuse_inside_consumer("a call" if "result_avals" in call_params else "a tap")
    lifecycle.ensure_started()
    outfeed.watch_interrupts()  # Ctrl-C reaches a computation that waits for the host
    return binding.bind(
        leaves, consumer_id=registry.register(consumer), transport=transport.default_transport(),
        ordered=ordered, device_index=device_index, flavor=flavor.value, **call_params)


def _is_key_array(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def flatten(arg):
    """The leaves to tap, their structure, and per leaf the PRNG implementation of a key array
    (empty when there are none): a key travels as its key data and is a key again on the host."""
    paths_and_leaves, treedef = tree_util.tree_flatten_with_path(arg)
    key_impls = tuple(str(jax.random.key_impl(leaf)) if _is_key_array(leaf) else None
                      for _, leaf in paths_and_leaves)
    if not any(key_impls):
        key_impls = ()
    leaves = [_leaf_to_array(path, jax.random.key_data(leaf) if impl else leaf)
              for (path, leaf), impl in zip(paths_and_leaves, key_impls or repeat(None))]
    return leaves, treedef, key_impls


def unflatten(treedef, outs, key_impls: tuple):
    """What a tap returns: its argument, with key arrays made keys again."""
    if key_impls:
        outs = [jax.random.wrap_key_data(out, impl=impl) if impl else out
                for out, impl in zip(outs, key_impls)]
    return tree_util.tree_unflatten(treedef, outs)


def check_arity(func: Callable[..., Any], api: str, positional: int, with_device: bool,
                 called_as: str, right_form: str, keywords: tuple[str, ...] = ()) -> None:
    """Refuses at trace time a function the receiver could not call, with the right form,
    instead of an error at the next barrier. Functions without a signature are not checked."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    bound_keywords = dict.fromkeys(keywords) | ({"device": None} if with_device else {})
    try:
        signature.bind(*([None] * positional), **bound_keywords)
    except TypeError as error:
        name = getattr(func, "__name__", type(func).__name__)
        raise TypeError(
            f"{api}() will call {called_as}, but {name}{signature} cannot be called that way "
            f"({error}). Write it as {right_form}") from None


def tap_only_params(partitioned: bool, replays: str) -> dict:
    if replays not in REPLAYS:
        raise ValueError(f"replays must be one of {', '.join(map(repr, REPLAYS))}, "
                         f"got {replays!r}")
    return {"partitioned": bool(partitioned), "replays": replays}


def result_spec(result_shape) -> tuple[tree_util.PyTreeDef, tuple]:
    """The structure and (shape, dtype) of each leaf of ``result_shape``, checked at trace time."""
    if result_shape is None:
        result_shape = ()
    paths_and_leaves, treedef = tree_util.tree_flatten_with_path(result_shape)
    avals = []
    for path, leaf in paths_and_leaves:
        where = f"result_shape{tree_util.keystr(path)}"
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            shape, dtype = leaf.shape, leaf.dtype
        elif isinstance(leaf, (bool, int, float, complex, np.generic)):
            shape, dtype = (), np.asarray(leaf).dtype
        else:
            raise ValueError(
                f"{where} is of type {type(leaf).__name__} ({leaf!r:.60}). result_shape should "
                "be a pytree of values with structure matching the expected result of the callback "
                "function. The values must be either numeric scalars, or must have 'shape' and "
                "'dtype' attributes (e.g. jax.ShapeDtypeStruct)")
        try:
            shape = tuple(int(d) for d in shape)
            dtype = jax.dtypes.canonicalize_dtype(dtype)
            wire.dtype_code(dtype)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"{where} has a negative dimension in {shape}")
        avals.append((shape, np.dtype(dtype)))
    return treedef, tuple(avals)


def bind_call(callback_func: Callable[..., Any], arg: Any, *, result_shape: Any,
              call_with_device: bool = False, device_index: int = 0,
              timeout: float | None = None, ordered: bool | None = None,
              callback_flavor: CallbackFlavor | str | None = None,
              vmap_method: str | None = None, jax_api: str = "") -> Any:
    """A call of ``callback_func(arg)`` on the host whose result comes back into the computation,
    for ``call`` and for the functions with JAX's signatures (``jax_api`` names the one)."""
    if not callable(callback_func):
        raise TypeError(
            f"call() needs a callable callback_func, got {type(callback_func).__name__}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(callback_func, CallWithArgs):
        check_arity(callback_func, "call", 1, call_with_device,
                    "callback_func(arg" + (", device=d)" if call_with_device else ")"),
                    "def callback_func(arg" + (", device):" if call_with_device else "):")
                    + " ...  (pack several arguments into one pytree: call(f, (x, y)) calls "
                    "f((x, y)))")
    flavor = flavor_of(callback_flavor)
    check_vmap_method(vmap_method)
    leaves, treedef, key_impls = flatten(arg)
    result_treedef, result_avals = result_spec(result_shape)
    if flavor is CallbackFlavor.DEBUG and result_avals:
        raise ValueError(
            "a call with callback_flavor=CallbackFlavor.DEBUG cannot return a result (like "
            "jax.debug.callback); drop result_shape, or use IO_CALLBACK or PURE")
    consumer = Consumer(func=callback_func, treedef=treedef, with_device=call_with_device,
                        name=name_of(callback_func),
                        result_treedef=result_treedef, result_avals=result_avals,
                        key_impls=key_impls, x64=bool(jax.config.jax_enable_x64),
                        jax_api=jax_api)
    if flavor is CallbackFlavor.DEBUG:
        # Nothing comes back, so the device does not wait: the record travels as a tap does.
        bind_tap(consumer, leaves, device_index, ordered, flavor)
        return None
    outs = bind_tap(consumer, leaves, device_index, ordered, flavor,
                    result_avals=tuple(jx.ShapedArray(shape, dtype)
                                       for shape, dtype in result_avals),
                    timeout_s=float(timeout or 0.0), vmap_method=vmap_method)
    return None if result_shape is None else tree_util.tree_unflatten(result_treedef, outs)


class CallWithArgs(EqualByKey):
    """``callback(*args, **kwargs)`` as a consumer: called with ``(args, kwargs)`` as one argument
    (a call's) or through ``apply(args, kwargs)`` (a debug callback's, per batch element). Equal
    for equal callbacks, so that retracing reuses the consumer id. With ``as_jax_arrays`` (a call
    made outside any transformation) the arrays are handed over as jax.Arrays on a CPU device,
    and the callback runs with that device as the default, as JAX's callbacks do."""

    __slots__ = ("__name__", "as_jax_arrays", "callback")

    def __init__(self, callback: Callable[..., Any], as_jax_arrays: bool = False) -> None:
        self.callback, self.as_jax_arrays = callback, as_jax_arrays
        self.__name__ = name_of(callback)

    def _key(self):
        return (self.callback, self.as_jax_arrays)

    def __call__(self, packed):
        return self.apply(*packed)

    def apply(self, args: tuple, kwargs: dict) -> Any:
        if not self.as_jax_arrays:
            return self.callback(*args, **kwargs)
        cpu = jax.local_devices(backend="cpu")[0]
        args, kwargs = tree_util.tree_map(
            lambda leaf: jax.device_put(leaf, cpu) if isinstance(leaf, np.ndarray) else leaf,
            (args, kwargs))
        with jax.default_device(cpu):
            return self.callback(*args, **kwargs)


class FormatCheck(string.Formatter):
    """A format string's fields against the values given, at trace time (nothing is formatted).

    With ``jax_rules`` (``jax.debug.print``'s check, JAX's errors): ``string.Formatter`` formats
    it as JAX's check does, so a field without a value raises what that raises, a value without a
    field JAX's ValueError. Without (id_print's, checked as ``str.format`` will read it on the
    host): a field without a value, in a format spec too, is a ValueError that names the field
    and says what to pass, as is a string that numbers some fields and not others; values
    without a field are fine, and only a field's leading name is checked (its attributes and
    indexes are the host array's, not a tracer's).
    """

    def __init__(self, api: str, jax_rules: bool) -> None:
        self.api, self.jax_rules, self.fmt = api, jax_rules, ""

    def check(self, fmt: str, args: tuple, kwargs: dict) -> None:
        self.fmt = fmt
        if self.jax_rules:
            self.format(fmt, *args, **kwargs)
            return
        try:
            self._check_fields(fmt, args, kwargs, {"auto": 0, "kinds": set()}, depth=2)
        except ValueError as error:
            if str(error).startswith(f"{self.api}("):
                raise
            raise ValueError(f"{self.api}({fmt!r}, ...): not a valid format string: "
                             f"{error}") from None

    def _check_fields(self, fmt: str, args: tuple, kwargs: dict, numbering: dict,
                      depth: int) -> None:
        for _, field, spec, _ in self.parse(fmt):
            if field is None:
                continue
            name = field.split(".", 1)[0].split("[", 1)[0]
            numbering["kinds"].add("automatic" if name == "" else
                                   "manual" if name.isdigit() else "named")
            if {"automatic", "manual"} <= numbering["kinds"]:
                raise ValueError("cannot switch between automatic and manual field numbering")
            if name == "":
                name, numbering["auto"] = str(numbering["auto"]), numbering["auto"] + 1
            if name.isdigit() and int(name) >= len(args):
                raise ValueError(f"{self.api}({self.fmt!r}, ...) has a field {{{field}}} but "
                                 f"only {len(args)} positional value(s) after the format string")
            if not name.isdigit() and name not in kwargs:
                raise ValueError(f"{self.api}({self.fmt!r}, ...) has a field {{{field}}} but no "
                                 f"keyword argument {name}=...; pass {self.api}(fmt, "
                                 f"{name}=value)")
            if spec and depth > 1:
                self._check_fields(spec, args, kwargs, numbering, depth - 1)

    def format_field(self, value: Any, format_spec: str) -> str:
        return ""

    def check_unused_args(self, used_args, args, kwargs) -> None:
        unused_args = [arg for i, arg in enumerate(args) if i not in used_args]
        unused_kwargs = [k for k in kwargs if k not in used_args]
        if unused_args:
            raise ValueError(f"Unused positional arguments to `jax.debug.print`: {unused_args}")
        if unused_kwargs:
            raise ValueError(
                f"Unused keyword arguments to `jax.debug.print`: {unused_kwargs}. You may be "
                "passing an f-string (i.e, `f\"{x}\"`) into `jax.debug.print` and instead "
                "should pass in a regular string.")


class OnHost(EqualByKey):
    """``hostcallback.debug``'s callback or printer (anything with ``apply(args, kwargs)``) as it
    goes through ``jax.debug.callback``: called with its arguments and keywords packed in two
    (so that keywords named like JAX's options reach it), served by hostcallback whether the
    switch is on or not (served_callbacks.py): a callback gets jax.Arrays there, a printer
    read-only numpy views (``HostArray``)."""

    __slots__ = ("__name__", "target")

    def __init__(self, target: Any, name: str) -> None:
        self.target, self.__name__ = target, name

    def _key(self):
        return (self.target,)

    def __call__(self, args: tuple, kwargs: dict) -> None:
        self.target.apply(args, kwargs)
