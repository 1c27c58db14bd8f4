"""The legacy host_callback API: id_tap, id_print, call, barrier_wait, stop_outfeed_receiver,
and what goes with them (taps_delivered, queue_stats). The functions with JAX's signatures are in
jax_callbacks.py.

The functions are thin on purpose; tapping.py builds the tap or call, the primitive's rules
(_trace/) and the receivers (_host/) do the work. Every mistake a user can make here is answered
at trace time with an error that names the argument and says what to do instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from hostcallback._host.printing import Printer
from hostcallback._host.receiver import receivers
from hostcallback._records.registry import Consumer
from hostcallback.flavors import CallbackFlavor, flavor_of
from hostcallback.lifecycle import lifecycle
from hostcallback.tapping import (
    FormatCheck,
    bind_call,
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
    printer = Printer(output_stream=output_stream, threshold=threshold, metadata=kwargs)
    consumer = Consumer(func=printer, treedef=treedef, with_device=tap_with_device,
                        metadata=tuple(sorted((k, repr(v)) for k, v in kwargs.items())),
                        name=str(kwargs.get("what", "id_print")), key_impls=key_impls)
    outs = bind_tap(consumer, leaves, device_index, ordered, flavor_of(callback_flavor),
                    **tap_only_params(partitioned, replays))
    return result if result is not None else unflatten(treedef, outs, key_impls)


def _id_print_formatted(fmt: str, args: tuple, kwargs: dict, *, result: Any,
                        tap_with_device: bool, output_stream: TextIO | None, device_index: int,
                        ordered: bool | None, flavor: CallbackFlavor, params: dict) -> Any:
    """Taps ``(args, kwargs)`` for a format string; the string itself stays on the host."""
    refuse_pure_when_unused(flavor, "id_print with a format string", "its outputs are never "
                             "returned")
    FormatCheck("id_print", jax_rules=False).check(fmt, args, kwargs)
    leaves, treedef, key_impls = flatten((tuple(args), dict(kwargs)))
    consumer = Consumer(func=Printer(fmt, output_stream=output_stream), treedef=treedef,
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
    computation with taps fails with an error that says the receiver was stopped. A stop before
    any receiver started does nothing, as legacy host_callback's did: a later tap starts them.
    ``timeout`` bounds the whole stop (delivering and joining the threads), in seconds.
    """
    lifecycle.stop(timeout=timeout)


def queue_stats() -> dict[Any, dict[str, Any]]:
    """Per local device: records and bytes enqueued and delivered, bytes queued now and at peak,
    how often and how long the device waited for room, and records the receiver handled."""
    return receivers.queue_stats()


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
    return bind_call(callback_func, arg, result_shape=result_shape,
                     call_with_device=call_with_device, device_index=device_index,
                     timeout=timeout, ordered=ordered, callback_flavor=callback_flavor,
                     vmap_method=vmap_method)


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
