"""The public tap API: validate what the user passed, flatten it, register a consumer, bind.

The functions are thin on purpose; the primitive's rules (primitive.py, or portable.py) and the
receivers (receiver.py) do the work. Every mistake a user can make here is answered at trace
time with an error that names the argument and says what to do instead.
"""

from __future__ import annotations

import contextlib
import string
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax
import numpy as np
from jax import tree_util

from hostcallback import _jax as jx
from hostcallback._host import printing
from hostcallback._host.receiver import receivers
from hostcallback._records import wire
from hostcallback._records.registry import Consumer, EqualByKey
from hostcallback.errors import name_of
from hostcallback.flavors import CallbackFlavor, check_vmap_method, flavor_of
from hostcallback.lifecycle import lifecycle
from hostcallback.tapping import (
    bind_tap,
    check_arity,
    flatten,
    refuse_pure_when_unused,
    tap_only_params,
    unflatten,
)


def _accept_tap_with_transform(kwargs: dict) -> None:
    """Tutorials pass tap_with_transform=True; transforms are always passed here, so it is
    accepted (and False, which would ask for something we do not do, is refused clearly)."""
    if kwargs.pop("tap_with_transform", True) is not True:
        raise TypeError(
            "tap_with_transform=False is not supported: tap functions are always called as "
            "tap_func(arg, transforms). Ignore the second argument if you do not need it.")


def id_tap(tap_func: Callable[..., Any], arg: Any, *, result: Any = None,
           tap_with_device: bool = False, device_index: int = 0, ordered: bool | None = None,
           callback_flavor: CallbackFlavor | str | None = None, partitioned: bool = False,
           replays: str = "deliver", **kwargs: Any) -> Any:
    """Sends ``arg`` to ``tap_func(arg, transforms)`` on the host; returns ``arg`` (or ``result``).

    The device only copies the values into its outfeed queue and goes on; a receiver thread calls
    ``tap_func`` later, per device in the order the device produced the records. With
    ``tap_with_device=True`` the call is ``tap_func(arg, transforms, device=d)``. Errors in
    ``tap_func`` surface at the next ``barrier_wait()`` as CallbackException.

    Per device, taps run in program order, across loops, branches and nested jits. With
    ``ordered=True`` (default: ``HOSTCALLBACK_ORDERED``) they also keep order across separate
    computations, at the cost of JAX's slower dispatch (see "Performance" in the documentation).
    ``callback_flavor=CallbackFlavor.PURE`` lets JAX drop the tap when its result is unused.
    ``device_index`` picks which of a computation's devices taps a value that is not split over
    them (a sharded jit); under pmap and shard_map each device taps its own part. With
    ``partitioned=True`` each device of a sharded jit taps its own shard instead (no gather), and
    ``transforms`` ends with ``("shard", {"index", "offset", "global_shape"})``.
    ``replays`` says what a tap does when ``jax.checkpoint`` recomputes it under grad: "deliver"
    (fire again, as legacy), "mark" (fire with ``("remat_replay", {})`` in ``transforms``) or
    "skip".
    """
    _accept_tap_with_transform(kwargs)
    if kwargs:
        raise TypeError(
            "Support for **kwargs in ``id_tap`` has been removed. Instead, pre-apply keyword "
            "arguments, either by using a closure or by passing "
            "``functools.partial(tap_func, **kwargs)``. "
            f"(id_tap() got keyword argument(s) {', '.join(sorted(kwargs))}; tap functions are "
            "called as tap_func(arg, transforms), so bind the others first: "
            "id_tap(functools.partial(tap_func, name=value), arg).)")
    if not callable(tap_func):
        raise TypeError(f"id_tap() needs a callable tap_func, got {type(tap_func).__name__}")
    check_arity(tap_func, "id_tap", 2, tap_with_device,
                 "tap_func(arg, transforms" + (", device=d)" if tap_with_device else ")"),
                 "def tap_func(arg, transforms" + (", device):" if tap_with_device else "):")
                 + " ...  (a jax.debug.callback-style fn(x) becomes "
                 "lambda x, transforms: fn(x))")
    flavor = flavor_of(callback_flavor)
    if result is not None:
        refuse_pure_when_unused(flavor, "id_tap(..., result=...)", "it returns result, not the "
                                 "tap's outputs")
    leaves, treedef, key_impls = flatten(arg)
    consumer = Consumer(func=tap_func, treedef=treedef, with_device=tap_with_device,
                        name=getattr(tap_func, "__name__", ""), key_impls=key_impls)
    outs = bind_tap(consumer, leaves, device_index, ordered, flavor,
                **tap_only_params(partitioned, replays))
    return result if result is not None else unflatten(treedef, outs, key_impls)


class _Printer(EqualByKey):
    """id_print's consumer; equal for equal streams, thresholds and metadata."""

    __slots__ = ("metadata", "output_stream", "threshold")

    def __init__(self, output_stream: TextIO | None, threshold: int | None,
                 metadata: dict[str, Any]) -> None:
        self.output_stream, self.threshold, self.metadata = output_stream, threshold, metadata

    def _key(self):
        return (id(self.output_stream), self.threshold, repr(sorted(self.metadata.items())))

    def __call__(self, arg, transforms, device=None):
        printing.print_tap(arg, transforms, device=device, output_stream=self.output_stream,
                           threshold=self.threshold, **self.metadata)


class _FormatPrinter(EqualByKey):
    """id_print's consumer for a format string; equal for equal strings and streams."""

    __slots__ = ("fmt", "output_stream")

    def __init__(self, fmt: str, output_stream: TextIO | None) -> None:
        self.fmt, self.output_stream = fmt, output_stream

    def _key(self):
        return (self.fmt, id(self.output_stream))

    def __call__(self, arg, transforms, device=None):
        args, kwargs = arg
        printing.print_formatted(self.fmt, args, kwargs, transforms, device=device,
                                 output_stream=self.output_stream)


def id_print(arg: Any, *fmt_args: Any, result: Any = None, tap_with_device: bool = False,
             output_stream: TextIO | None = None, threshold: int | None = None,
             ordered: bool | None = None, device_index: int = 0,
             callback_flavor: CallbackFlavor | str | None = None, partitioned: bool = False,
             replays: str = "deliver", **kwargs: Any) -> Any:
    """Prints ``arg`` on the host (as ``id_tap`` would deliver it); returns ``arg`` (or ``result``).

    Keyword arguments become a first line of sorted ``key: value`` metadata, e.g.
    ``id_print(loss, what="loss")`` prints ``what: loss`` and then the value. The other
    keywords mean what they mean for ``id_tap``.

    With a format string, as ``jax.debug.print`` is written, the other positional and keyword
    arguments are tapped and formatted on the host with ``str.format``:
    ``id_print("step {step}: loss {loss:.4f}", step=step, loss=loss)`` prints one line and
    returns ``result`` (None without one); ``fmt_args`` are those positional arguments.

    ``output_stream`` (default: standard output) is where it prints, and ``threshold`` is
    numpy's summarisation threshold for the arrays. ``tap_with_device`` prints the device too.
    ``ordered``, ``device_index``, ``callback_flavor``, ``partitioned`` and ``replays`` mean what
    they mean for ``id_tap``.
    """
    _accept_tap_with_transform(kwargs)
    if isinstance(arg, str):
        return _id_print_formatted(arg, fmt_args, kwargs, result=result,
                                   tap_with_device=tap_with_device, output_stream=output_stream,
                                   device_index=device_index, ordered=ordered,
                                   flavor=flavor_of(callback_flavor),
                                   params=tap_only_params(partitioned, replays))
    if fmt_args:
        raise TypeError(
            f"id_print() got {len(fmt_args)} extra positional argument(s) after a value that is "
            "not a format string. Tap several values as one pytree, id_print((x, y)), or pass a "
            'format string first: id_print("x={} y={}", x, y)')
    if result is not None:
        refuse_pure_when_unused(flavor_of(callback_flavor), "id_print(..., result=...)",
                                 "it returns result, not the tap's outputs")
    leaves, treedef, key_impls = flatten(arg)
    printer = _Printer(output_stream, threshold, dict(kwargs))
    consumer = Consumer(func=printer, treedef=treedef, with_device=tap_with_device,
                        metadata=tuple(sorted((k, repr(v)) for k, v in kwargs.items())),
                        name=str(kwargs.get("what", "id_print")), key_impls=key_impls)
    outs = bind_tap(consumer, leaves, device_index, ordered, flavor_of(callback_flavor),
                **tap_only_params(partitioned, replays))
    return result if result is not None else unflatten(treedef, outs, key_impls)


def _check_format_fields(fmt: str, args: tuple, kwargs: dict) -> None:
    """A field with no value would fail on the host, at the next barrier; refuse it here."""
    auto = 0
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(fmt) if field is not None]
    except ValueError as error:
        raise ValueError(f"id_print({fmt!r}, ...): not a valid format string: {error}") from None
    for field in fields:
        name = field.split(".", 1)[0].split("[", 1)[0]
        if name == "":
            name, auto = str(auto), auto + 1
        if name.isdigit() and int(name) >= len(args):
            raise ValueError(f"id_print({fmt!r}, ...) has a field {{{field}}} but only "
                             f"{len(args)} positional value(s) after the format string")
        if not name.isdigit() and name not in kwargs:
            raise ValueError(f"id_print({fmt!r}, ...) has a field {{{field}}} but no keyword "
                             f"argument {name}=...; pass id_print(fmt, {name}=value)")


def _id_print_formatted(fmt: str, args: tuple, kwargs: dict, *, result: Any,
                        tap_with_device: bool, output_stream: TextIO | None, device_index: int,
                        ordered: bool | None, flavor: CallbackFlavor, params: dict) -> Any:
    """Taps ``(args, kwargs)`` for a format string; the string itself stays on the host."""
    refuse_pure_when_unused(flavor, "id_print with a format string", "its outputs are never "
                             "returned")
    _check_format_fields(fmt, args, kwargs)
    leaves, treedef, key_impls = flatten((tuple(args), dict(kwargs)))
    consumer = Consumer(func=_FormatPrinter(fmt, output_stream), treedef=treedef,
                        with_device=tap_with_device, name="id_print",
                        metadata=(("format", fmt),), key_impls=key_impls)
    bind_tap(consumer, leaves, device_index, ordered, flavor, **params)
    return result


def barrier_wait(logging_name: str | None = None, *, timeout: float | None = None) -> None:
    """Waits until every tap of every computation dispatched so far has been handled.

    Raises CallbackException if a tap consumer raised since the last barrier (the first error is
    its ``__cause__``), and TimeoutError if ``timeout`` seconds pass first. ``logging_name``
    names the barrier in hostcallback's debug log.
    """
    lifecycle.barrier_wait(logging_name, timeout=timeout)


@contextlib.contextmanager
def taps_delivered(*, timeout: float | None = None) -> Iterator[None]:
    """A block whose taps have all been handled when it ends: on leaving it, ``barrier_wait``.

    Taps stay asynchronous inside the block; leaving it waits for every tap dispatched so far.
    A consumer's ``warnings.warn`` therefore reaches a ``warnings.catch_warnings`` or
    ``pytest.warns`` around the block, and a consumer's error is raised there as
    CallbackException. The code inside needs no change::

        with pytest.warns(UserWarning), hcb.taps_delivered():
            model.fit(x, y)          # its taps warn on a receiver thread

    ``timeout`` bounds the wait on leaving the block, as ``barrier_wait``'s does.
    """
    yield
    lifecycle.barrier_wait(None, timeout=timeout)


def stop_outfeed_receiver(*, timeout: float | None = None) -> None:
    """Delivers every pending tap, then stops the receiver threads for good.

    Afterwards tracing a tap raises ReceiverStoppedError and running an already compiled
    computation with taps fails with an error that says the receiver was stopped. ``timeout``
    bounds the whole stop (delivering and joining the threads), in seconds.
    """
    lifecycle.stop(timeout=timeout)


def queue_stats() -> dict[Any, dict[str, Any]]:
    """Per local device: records and bytes enqueued and delivered, bytes queued now and at peak,
    how often and how long the device waited for room, and records the receiver handled."""
    return receivers.queue_stats()


def _result_spec(result_shape) -> tuple[tree_util.PyTreeDef, tuple]:
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
                f"{where} is a {type(leaf).__name__} ({leaf!r:.60}). result_shape should be a "
                "pytree of values with structure matching the expected result of the callback "
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


def call(callback_func: Callable[..., Any], arg: Any, *, result_shape: Any = None,
         call_with_device: bool = False, device_index: int = 0, timeout: float | None = None,
         ordered: bool | None = None, callback_flavor: CallbackFlavor | str | None = None,
         vmap_method: str | None = None, **kwargs: Any) -> Any:
    """Calls ``callback_func(arg)`` on the host and returns its result into the computation.

    ``result_shape`` (or its synonym ``result_shape_dtypes``) is a pytree of
    ``jax.ShapeDtypeStruct`` (or anything with ``.shape`` and ``.dtype``) or numeric scalars
    describing what the function returns; ``None`` or ``()`` means no result (the device still
    waits for the function to finish, unless the flavor is DEBUG). The device sends ``arg``
    through the same outfeed queue as taps and waits for the answer. If the function raises,
    returns the wrong structure, shape or dtype, or takes longer than ``timeout`` seconds, the
    computation fails with an error that names it; ``barrier_wait`` reports it too.
    ``call_with_device=True`` calls ``callback_func(arg, device=d)``. ``vmap_method`` says what
    vmap does, with ``jax.pure_callback``'s meanings; without one, vmap raises.
    ``device_index``, ``ordered`` and ``callback_flavor`` mean what they mean for ``id_tap``
    (``callback_flavor=CallbackFlavor.DEBUG``: no result, and the device does not wait).
    """
    result_shape = _result_shape_keyword(result_shape, kwargs)
    if kwargs:
        raise TypeError(f"call() got unexpected keyword argument(s) {', '.join(sorted(kwargs))}")
    _warn_if_a_shape_was_meant(result_shape)
    return _call(callback_func, arg, result_shape=result_shape,
                 call_with_device=call_with_device, device_index=device_index, timeout=timeout,
                 ordered=ordered, callback_flavor=callback_flavor, vmap_method=vmap_method)


def _call(callback_func: Callable[..., Any], arg: Any, *, result_shape: Any,
          call_with_device: bool = False, device_index: int = 0, timeout: float | None = None,
          ordered: bool | None = None, callback_flavor: CallbackFlavor | str | None = None,
          vmap_method: str | None = None, jax_api: str = "") -> Any:
    """call(), for call itself and for the functions with JAX's signatures (``jax_api``)."""
    if not callable(callback_func):
        raise TypeError(
            f"call() needs a callable callback_func, got {type(callback_func).__name__}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(callback_func, _CallWithArgs):
        check_arity(callback_func, "call", 1, call_with_device,
                     "callback_func(arg" + (", device=d)" if call_with_device else ")"),
                     "def callback_func(arg" + (", device):" if call_with_device else "):")
                     + " ...  (pack several arguments into one pytree: call(f, (x, y)) calls "
                     "f((x, y)))")
    flavor = flavor_of(callback_flavor)
    check_vmap_method(vmap_method)
    leaves, treedef, key_impls = flatten(arg)
    result_treedef, result_avals = _result_spec(result_shape)
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
                result_avals=tuple(jx.ShapedArray(shape, dtype) for shape, dtype in result_avals),
                timeout_s=float(timeout or 0.0), vmap_method=vmap_method)
    return None if result_shape is None else tree_util.tree_unflatten(result_treedef, outs)


def _warn_if_a_shape_was_meant(result_shape: Any) -> None:
    """``result_shape=(2,)`` is a tuple of one int scalar (legacy host_callback read it so too),
    but it is most often meant as a shape; the mismatch would only show at run time."""
    if (isinstance(result_shape, tuple) and result_shape
            and all(type(d) is int for d in result_shape)):
        warnings.warn(
            f"call(result_shape={result_shape!r}) describes a tuple of {len(result_shape)} "
            f"integer scalar(s), not an array of shape {result_shape!r}; for an array write "
            f"result_shape=jax.ShapeDtypeStruct({result_shape!r}, dtype)", stacklevel=3)


def _result_shape_keyword(result_shape: Any, kwargs: dict) -> Any:
    """``result_shape_dtypes`` (jax.pure_callback's name) is accepted as a synonym."""
    if "result_shape_dtypes" not in kwargs:
        return result_shape
    synonym = kwargs.pop("result_shape_dtypes")
    if result_shape is not None:
        raise TypeError("call() got both result_shape and result_shape_dtypes; they mean the "
                        "same thing, pass one")
    return synonym


class _CallWithArgs(EqualByKey):
    """Adapts ``callback(*args, **kwargs)`` to a call consumer's single argument; equal for equal
    callbacks, so that retracing reuses the consumer id. With ``as_jax_arrays`` (a call made
    outside any transformation) the arrays are handed over as jax.Arrays on a CPU device, and
    the callback runs with that device as the default, as JAX's callbacks do."""

    __slots__ = ("__name__", "as_jax_arrays", "callback")

    def __init__(self, callback: Callable[..., Any], as_jax_arrays: bool = False) -> None:
        self.callback, self.as_jax_arrays = callback, as_jax_arrays
        self.__name__ = name_of(callback)

    def _key(self):
        return (self.callback, self.as_jax_arrays)

    def __call__(self, packed):
        args, kwargs = packed
        if not self.as_jax_arrays:
            return self.callback(*args, **kwargs)
        cpu = jax.local_devices(backend="cpu")[0]
        args, kwargs = tree_util.tree_map(
            lambda leaf: jax.device_put(leaf, cpu) if isinstance(leaf, np.ndarray) else leaf,
            (args, kwargs))
        with jax.default_device(cpu):
            return self.callback(*args, **kwargs)


def _checked_callback(api: str, callback: Any, sharding: Any, args: tuple,
                      kwargs: dict) -> _CallWithArgs:
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
    return _CallWithArgs(callback, as_jax_arrays=not jx.is_tracing())


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
    return _call(_checked_callback("pure_callback", callback, sharding, args, kwargs),
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
    return _call(_checked_callback("io_callback", callback, sharding, args, kwargs),
                 (args, kwargs), result_shape=result_shape_dtypes, ordered=bool(ordered),
                 callback_flavor=CallbackFlavor.IO_CALLBACK,
                 vmap_method=None if ordered else "sequential", jax_api="io_callback")
