"""Building a tap or call from what a user passed, for api.py and debug.py alike: flattening the
value (arrays and numbers; PRNG keys travel as their key data), checking the options and the
function's arity at trace time, and binding it, once the receivers run.

Every mistake answered here is answered at trace time with an error that names the argument and
says what to do instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from itertools import repeat
from typing import Any

import jax
import numpy as np
from jax import tree_util

from hostcallback import config
from hostcallback._host import reentry
from hostcallback._native import outfeed
from hostcallback._records import wire
from hostcallback._records.registry import Consumer, registry
from hostcallback._trace import binding, transport
from hostcallback.errors import UnsupportedDtypeError
from hostcallback.flavors import REPLAYS, CallbackFlavor
from hostcallback.lifecycle import lifecycle

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _leaf_to_array(path, leaf):
    where = tree_util.keystr(path) or "the argument"
    if not isinstance(leaf, _ARRAY_TYPES):
        raise TypeError(
            f"hostcallback can only tap arrays and numbers, but {where} is a "
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


