"""JAX's own callback primitives, for the switch that serves them on hostcallback's transport
(hostcallback/served_callbacks.py).

Per primitive: what kind of tap it becomes, and how one of its equations runs on the host as JAX's
impl runs it: the arguments as jax.Arrays on a CPU device, the callback called with that device as
the default (and, for a debug callback, no mesh in force), its failure logged as JAX logs it. The
runner is prepared once per equation; per record it only places the arrays (jaxlib's
batched_device_put, a few microseconds, where jax.device_put takes 30). JAX 0.8 to 0.12 name and
shape these alike; where a piece this relies on is missing, the runner calls JAX's impl itself
(slower, the same result), and a primitive this JAX lacks is not served (its own lowering stays).
ImportError here means none can be.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import callback as _callback
from jax._src import core as _core
from jax._src import debugging as _debugging
from jax._src import mesh as _mesh
from jax._src import sharding_impls as _sharding
from jax._src.lib import xla_client as _xla_client

Runner = Callable[[tuple], tuple]  # the record's numpy leaves -> the callback's results


@dataclasses.dataclass(frozen=True)
class JaxCallbackPrimitive:
    """One of JAX's callback primitives, as the switch serves it."""

    primitive: Any
    kind: str  # "debug": a tap without results; "io" and "pure": a call with results
    prints: bool  # JAX's print: its runner is always given views (what is printed is the same)
    # (an equation's params, its operands' avals, None or what makes a leaf the read-only view a
    # debug callback is to get instead of a jax.Array) -> how to run its callback
    prepare: Callable[[dict, tuple, Callable | None], Runner]


# ---- arrays and context, as JAX's impls make them ------------------------------------------


_PLACE_FAST = all(hasattr(_xla_client, name) for name in ("batched_device_put",
                                                           "HostBufferSemantics"))
_HAS_CONCRETE_MESH = hasattr(_sharding, "_internal_use_concrete_mesh")


class _Placement:
    """Where and how a record's leaves become jax.Arrays: the first CPU device, found on first
    use (on the receiver thread, once JAX's backends are up), and the operands' avals (made
    once; a shard's differs)."""

    def __init__(self, in_avals: tuple) -> None:
        self.in_avals = tuple(_core.ShapedArray(a.shape, a.dtype) for a in in_avals)
        self.device = self.sharding = None

    def arrays(self, leaves: tuple) -> tuple:
        """The record's read-only views as jax.Arrays of their own (copied: the record's memory
        is reused once the consumer returns) on the device."""
        if self.device is None:
            self.device = jax.local_devices(backend="cpu")[0]
            self.sharding = jax.sharding.SingleDeviceSharding(self.device)
        if not _PLACE_FAST:
            return tuple(jax.device_put(np.array(leaf), self.device) for leaf in leaves)
        copy = _xla_client.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
        # A partitioned callback's record holds one shard, not the operand's global shape.
        return tuple(_xla_client.batched_device_put(
            aval if aval.shape == leaf.shape else _core.ShapedArray(leaf.shape, leaf.dtype),
            self.sharding, [leaf], [self.device], True, True, copy)
            for aval, leaf in zip(self.in_avals, leaves))


def _run(callback: Callable, arrays: tuple, device, *, debug: bool) -> Any:
    """callback(*arrays) with ``device`` the default (and for a debug callback no mesh in
    force)."""
    with jax.default_device(device):
        if not debug:
            return callback(*arrays)
        with _mesh.use_abstract_mesh(_mesh.empty_abstract_mesh):
            if not _HAS_CONCRETE_MESH:
                return callback(*arrays)
            with _sharding._internal_use_concrete_mesh(_mesh.empty_concrete_mesh):
                return callback(*arrays)


class _LogsAsJax:
    """What JAX's impl logs when a callback raises, on JAX's logger: for a call every time (its
    computation fails there); for a debug callback at most once a second, since its computation
    runs on to its end and a callback in a loop would flood the log (the receiver's own log
    counts the rest)."""

    def __init__(self, logger, message: str, every_time: bool) -> None:
        self.logger, self.message, self.every_time = logger, message, every_time
        self.last = -float("inf")

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        now = time.monotonic()
        if error is not None and (self.every_time or now - self.last >= 1.0):
            self.last = now
            self.logger.error(self.message, exc_info=(kind, error, traceback))
        return False


# ---- the four primitives -------------------------------------------------------------------


def _prepare_debug_callback(params: dict, in_avals: tuple, views: Callable | None) -> Runner:
    """As debug_callback_impl runs it: with jax.Arrays; or, given ``views``, with the leaves as
    ``views`` makes them (read-only numpy arrays that print as jax.Arrays do)."""
    callback, placement = params["callback"], _Placement(in_avals)
    logs = _LogsAsJax(_debugging.logger, "jax.debug.callback failed", every_time=False)

    def run(leaves: tuple) -> tuple:
        with logs:
            if views is None:
                _run(callback, placement.arrays(leaves), placement.device, debug=True)
            else:
                callback(*map(views, leaves))
        return ()
    return run


_PRINT_PARAMS = {"fmt", "ordered", "partitioned", "in_tree", "static_args", "np_printoptions",
                 "has_placeholders", "logging_record"}
_PRINT_PIECES = all(hasattr(_debugging, name) for name in ("_make_flat_callback",
                                                           "_format_print_callback"))


def _prepare_debug_print(params: dict, in_avals: tuple, views: Callable | None) -> Runner:
    """JAX's print formatting, built once per equation as debug_print_impl builds it per call,
    given the leaves as read-only numpy views that print as jax.Arrays do (what is printed is
    the same, without placing arrays on a device)."""
    if not (_PRINT_PIECES and set(params) == _PRINT_PARAMS):
        return lambda leaves: (_debugging.debug_print_p.impl(*leaves, **params), ())[1]
    callback = _debugging._make_flat_callback(params["in_tree"], functools.partial(
        _debugging._format_print_callback, params["fmt"], dict(params["np_printoptions"]),
        params["has_placeholders"], params["logging_record"]), params["static_args"])
    return _prepare_debug_callback({"callback": callback}, in_avals, views)


def _prepare_call(api: str) -> Callable[[dict, tuple, Callable | None], Runner]:
    def prepare(params: dict, in_avals: tuple, views: Callable | None) -> Runner:
        """As pure_callback_impl and io_callback_impl run it: with jax.Arrays, its results as
        numpy arrays."""
        del views  # a call's callback gets jax.Arrays, as JAX's
        callback, placement = params["callback"], _Placement(in_avals)
        logs = _LogsAsJax(_callback.logger, f"jax.{api} failed", every_time=True)

        def run(leaves: tuple) -> tuple:
            with logs:
                results = _run(callback, placement.arrays(leaves), placement.device,
                               debug=False)
            return tuple(np.asarray(result) for result in jax.tree.leaves(results))
        return run
    return prepare


def user_callback(params: dict) -> Any:
    """The user's function behind an equation's callback, or None: io and pure callbacks hold it
    in a _FlatCallback, a debug callback in the closure JAX flattens its arguments with."""
    callback = params.get("callback")
    function = getattr(callback, "callback_func", None)
    if function is None and callable(callback):
        cells = getattr(callback, "__closure__", None) or ()
        names = getattr(getattr(callback, "__code__", None), "co_freevars", ())
        try:
            function = dict(zip(names, (cell.cell_contents for cell in cells))).get("callback")
        except ValueError:  # an empty cell
            function = None
    return function


def callback_name(params: dict, default: str) -> str:
    return getattr(user_callback(params), "__name__", None) or default


def _found() -> tuple[JaxCallbackPrimitive, ...]:
    candidates = ((_debugging, "debug_callback_p", "debug", False, _prepare_debug_callback),
                  (_debugging, "debug_print_p", "debug", True, _prepare_debug_print),
                  (_callback, "pure_callback_p", "pure", False, _prepare_call("pure_callback")),
                  (_callback, "io_callback_p", "io", False, _prepare_call("io_callback")))
    return tuple(JaxCallbackPrimitive(getattr(module, name), kind, prints, prepare)
                 for module, name, kind, prints, prepare in candidates if hasattr(module, name))


SERVED = _found()
if not SERVED or not hasattr(_debugging, "logger") or not hasattr(_callback, "logger"):
    raise ImportError("this JAX has none of the callback primitives hostcallback knows")

# JAX's callback effects, by whether JAX orders them across computations.
_effect_types = (("DebugEffect", False), ("OrderedDebugEffect", True))
_io_effect_types = (("IOEffect", False), ("OrderedIOEffect", True))
EFFECT_ORDERED: dict[type, bool] = {
    getattr(module, name): ordered
    for module, names in ((_debugging, _effect_types), (_callback, _io_effect_types))
    for name, ordered in names if hasattr(module, name)}
