"""Consumer ids: the small integers a tap record carries, mapped to what the host must do with it.

Ids are made at trace time and are stable: registering the same function with the same pytree
structure, transforms and metadata returns the same id, so retracing a function yields an equal
primitive and JAX's compilation cache still hits. This module never calls consumers.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import tree_util

from hostcallback._native import outfeed

# Never handed out: a record with this consumer id is a barrier marker.
BARRIER_MARKER_ID = outfeed.BARRIER_MARKER_ID

Transform = tuple  # ("batch", {"batch_dims": (0,)}) or ("jvp",) and so on


class EqualByKey:
    """A consumer function that is equal to another, and hashes alike, when their ``_key()``s
    are: equal functions make equal consumers, so retracing reuses the consumer's id."""

    __slots__ = ()

    def _key(self) -> Any:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# Consumer.jax_api of JAX's debug callbacks and prints served by hostcallback.
DEBUG_CALLBACK_API = "debug_callback"


@dataclasses.dataclass(frozen=True)
class Consumer:
    """What to do with the records of one tap site."""

    func: Callable[..., Any]
    treedef: tree_util.PyTreeDef
    transforms: tuple[Transform, ...] = ()
    with_device: bool = False
    metadata: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs, e.g. id_print's kwargs
    name: str = ""
    # A `call` consumer: func(arg[, device=d]) returns a pytree of this structure and these avals.
    result_treedef: tree_util.PyTreeDef | None = None
    result_avals: tuple = ()
    # A partitioned tap: (device id, transform) pairs; the record's device picks one to append.
    per_device_transforms: tuple = ()
    # A call shared over a sharded jit's devices whose record holds the devices' shards
    # (sharded_lowering.lower_shared_call): (the whole values' shapes, per shard in the record
    # its leaf and offset), the arrays to assemble them into before the call; or ().
    gathered: tuple = ()
    # Per leaf, the PRNG implementation of a tapped key array (None for other leaves), or ()
    # when there are none: such a leaf arrives as key data and is handed on as a key array.
    key_impls: tuple = ()
    # A call traced with x64 on accepts only exact result dtypes (no float64 -> float32).
    x64: bool = False
    # "pure_callback" or "io_callback": a call made through hostcallback's function of that
    # name, which fails under transformations with JAX's own exceptions and messages, or one of
    # JAX's served by hostcallback; DEBUG_CALLBACK_API: a JAX debug callback or print served by
    # hostcallback (refused where JAX refuses it: ordered on several devices).
    jax_api: str = ""
    # A tap whose failure also fails the computation that made it, at its fence (a JAX debug
    # callback served by hostcallback, compiled with a fence: JAX fails the computation).
    fails_computation: bool = False

    # A tap function's ``tap_batch`` method (hostcallback._host.batches), taken once; never a
    # call's.
    tap_batch: Callable[..., Any] | None = dataclasses.field(
        default=None, init=False, compare=False, repr=False)
    # deliver(leaves, device): a tap's call, made once for this consumer (it runs per record).
    deliver: Callable[..., Any] = dataclasses.field(
        default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Looked up on the class: an object that answers every attribute (a Mock) takes no batches.
        if not self.is_call and getattr(type(self.func), "tap_batch", None) is not None:
            object.__setattr__(self, "tap_batch", self.func.tap_batch)
        object.__setattr__(self, "deliver", self._make_deliver())

    def _make_deliver(self) -> Callable[..., Any]:
        """invoke(), without the branches that never apply to this consumer: most taps are a
        plain function of one array or of a pytree, without device or key arrays."""
        if self.is_call or self.with_device or self.key_impls or self.per_device_transforms:
            return self.invoke
        func, transforms = self.func, self.transforms
        if self.treedef.num_nodes == 1 and self.treedef.num_leaves == 1:  # one array
            return lambda leaves, device: func(leaves[0], transforms)
        unflatten = self.treedef.unflatten
        return lambda leaves, device: func(unflatten(leaves), transforms)

    @property
    def is_call(self) -> bool:
        return self.result_treedef is not None

    def arg_of(self, leaves) -> Any:
        """The tapped pytree, rebuilt from a record's leaves (key data as key arrays)."""
        if self.key_impls:
            leaves = [_as_key(leaf, impl) if impl else leaf
                      for leaf, impl in zip(leaves, self.key_impls)]
        return tree_util.tree_unflatten(self.treedef, leaves)

    def invoke(self, leaves, device) -> Any:
        """Rebuilds the tapped pytree and calls the consumer the way the legacy API did:
        taps as func(arg, transforms), calls as func(arg), each with device=d when asked."""
        if self.gathered:
            leaves = assemble_shards(leaves, *self.gathered)
        arg = self.arg_of(leaves)
        args = (arg,) if self.is_call else (arg, self.transforms_for(device))
        if self.with_device:
            return self.func(*args, device=device)
        return self.func(*args)

    def transforms_for(self, device) -> tuple[Transform, ...]:
        for device_id, transform in self.per_device_transforms:
            if device is not None and device_id == device.id:
                return self.transforms + (transform,)
        return self.transforms

    def with_transform(self, transform: Transform) -> Consumer:
        return dataclasses.replace(self, transforms=self.transforms + (transform,))


def assemble_shards(leaves, shapes, pieces) -> list:
    """The whole values from the shards a shared call's devices sent: ``pieces[k]`` is
    (leaf, offset of its first element) of ``leaves[k]``. A shard that is the whole value is
    taken as it is."""
    whole: list = [None] * len(shapes)
    for shard, (leaf, starts) in zip(leaves, pieces):
        shape = tuple(shapes[leaf])
        if shard.shape == shape:
            whole[leaf] = shard
            continue
        if whole[leaf] is None:
            whole[leaf] = np.empty(shape, shard.dtype)
        whole[leaf][tuple(slice(s, s + n) for s, n in zip(starts, shard.shape))] = shard
    for value in whole:
        value.flags.writeable = False  # as every array a consumer gets
    return whole


def _as_key(key_data, impl: str):
    """A key array on the host; wrap_key_data only places the data, it runs no computation,
    so it cannot wait behind a device that waits for this receiver."""
    return jax.random.wrap_key_data(key_data, impl=impl)


def _freeze(value: Any) -> Any:
    """A hashable stand-in for transform params and metadata (dicts and lists become tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("<unhashable>", id(value))
    return value


class ConsumerRegistry:
    """Thread-safe map of consumer ids to consumers, deduplicated by value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, Consumer] = {}
        self._by_key: dict[Any, int] = {}
        self._next = itertools.count(BARRIER_MARKER_ID + 1)

    def register(self, consumer: Consumer) -> int:
        key = (_freeze(consumer.func), consumer.treedef, _freeze(consumer.transforms),
               consumer.with_device, _freeze(consumer.metadata), consumer.name,
               consumer.result_treedef, consumer.result_avals,
               _freeze(consumer.per_device_transforms), consumer.gathered, consumer.key_impls,
               consumer.x64,
               consumer.jax_api, consumer.fails_computation)
        with self._lock:
            found = self._by_key.get(key)
            if found is not None:
                return found
            consumer_id = next(self._next)
            self._by_key[key] = consumer_id
            self._by_id[consumer_id] = consumer
            return consumer_id

    @property
    def by_id(self) -> dict[int, Consumer]:
        """The live id -> consumer map, for the receivers' per-record lookup (read it only)."""
        return self._by_id

    def get(self, consumer_id: int) -> Consumer:
        try:
            return self._by_id[consumer_id]
        except KeyError:
            raise KeyError(
                f"no consumer is registered with id {consumer_id}: the record did not come from a "
                "tap traced in this process") from None


registry = ConsumerRegistry()
