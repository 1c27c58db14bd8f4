"""Checks what a ``call`` consumer returned against the result shapes declared at trace time.

The device waits for these bytes, so a wrong answer must become a clear error that names the
consumer and the mismatch, never bytes of the wrong size.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
from jax import tree_util

from hostcallback._records.registry import Consumer
from hostcallback.errors import CallResultError


def _describe(dtype, shape) -> str:
    return f"{np.dtype(dtype)}{list(shape)}"


# What JAX's dtype canonicalisation does with x64 off; with x64 on it changes nothing.
_X64_OFF = {np.dtype(wide): np.dtype(narrow) for wide, narrow in (
    (np.float64, np.float32), (np.int64, np.int32), (np.uint64, np.uint32),
    (np.complex128, np.complex64))}


def _canonical(dtype: np.dtype, x64: bool) -> np.dtype:
    return dtype if x64 else _X64_OFF.get(dtype, dtype)


_warned_lock = threading.Lock()
_warned: set[int] = set()  # ids of the call consumers whose dropped answers were reported


def _warn_once_dropped(consumer: Consumer, result: Any) -> None:
    with _warned_lock:
        if id(consumer) in _warned:
            return
        _warned.add(id(consumer))
    try:  # -W error would make the warning fail the call: it is only advice
        warnings.warn(
            f"hostcallback.call({consumer.name}, ...) has no result_shape, so what the function "
            f"returned ({type(result).__name__}) is dropped and the call returns None. To get it "
            "back, declare it: result_shape=jax.ShapeDtypeStruct(shape, dtype) (a pytree of "
            "them).", UserWarning, stacklevel=2)
    except Warning:
        pass


def result_leaves(consumer: Consumer, result: Any) -> list[np.ndarray]:
    """The result's leaves as C-contiguous arrays, exactly of the declared shapes and dtypes.

    Python numbers are converted to the declared dtype. An array is accepted when JAX's
    canonicalisation of its dtype is the declared one (with x64 off numpy's float64 becomes
    float32, int64 int32, complex128 complex64), as legacy ``call`` and ``jax.pure_callback`` do;
    any other dtype is an error. The result's leaves are matched in order, whatever containers
    hold them, as JAX matches them (a list where a tuple is declared). Whether x64 is on is what
    it was where the call was traced (a receiver thread does not see ``jax.enable_x64``
    contexts). A call without results drops what
    its function returns, and says so once per call site when that is not None.
    """
    if not consumer.result_avals:
        if result is not None:
            _warn_once_dropped(consumer, result)
        return []
    leaves, treedef = tree_util.tree_flatten(result)
    # As jax.pure_callback: the leaves count, in order; a list for a declared tuple is fine.
    if treedef != consumer.result_treedef and len(leaves) != consumer.result_treedef.num_leaves:
        raise CallResultError(
            f"call consumer {consumer.name} returned a value of structure {treedef}; its "
            f"result_shape has structure {consumer.result_treedef}")
    out = []
    for index, (leaf, (shape, dtype)) in enumerate(zip(leaves, consumer.result_avals)):
        if isinstance(leaf, (bool, int, float, complex)):
            leaf = np.asarray(leaf, dtype=dtype)
        array = np.asarray(leaf)
        if array.shape == tuple(shape) and _canonical(array.dtype, consumer.x64) == dtype:
            array = array.astype(dtype, copy=False)
        if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
            raise CallResultError(
                f"call consumer {consumer.name} returned {_describe(array.dtype, array.shape)} "
                f"for result leaf {index}; its result_shape says {_describe(dtype, shape)}")
        out.append(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return out
