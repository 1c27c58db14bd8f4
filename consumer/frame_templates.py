"""Frames for a whole batch of one tap site's records, put together in C++.

The records of one tap site from one device differ only in their arrays' bytes, the step, the
sequence number and the time. A FrameTemplate packs everything else once, with the general
encoder (``TapRecord.to_map``) around unique hole markers, and cuts the packed bytes at the
holes; ``frame_records`` in the consumers' extension (consumer/_native/frames.cc) then fills the
holes for every record of a batch.
A template is used only after the frame it gives for a real record was compared, byte for byte,
with the general encoder's frame of that record: a value the pieces cannot describe (custom
pytree nodes written by their repr, a step that is not an integer) gets no template, and its
records are framed in Python, one by one. This module never decides what a record holds.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np
from jax import tree_util

from hostcallback.addons import LEAVES, SEQUENCE, RecordBatch

from . import native_frames
from .stream import TapRecord, encode_value, frame_item, pack

_STEP_KINDS = ("i", "u", "b")  # integer and bool steps; a float step is int()-ed in Python


def step_of(value: Any) -> int | None:
    """A record's step: the ``step`` entry of a dict value, as an int (its first element when
    it is not 0-d)."""
    step = value.get("step") if isinstance(value, dict) else None
    if step is not None:
        step = int(step) if getattr(step, "ndim", 1) == 0 else \
            int(np.asarray(step).reshape(-1)[0])
    return step


class FrameTemplate:
    """The fixed pieces of one tap site's frames from one device, and where the holes go."""

    __slots__ = ("leaf_dtypes", "leaf_shapes", "pieces", "step_kind", "step_leaf", "step_size")

    def __init__(self, pieces: list[bytes], leaves: tuple[np.ndarray, ...], step_leaf: int,
                 step_kind: str, step_size: int) -> None:
        self.pieces = pieces
        self.leaf_dtypes = [leaf.dtype for leaf in leaves]
        self.leaf_shapes = [leaf.shape for leaf in leaves]
        self.step_leaf, self.step_kind, self.step_size = step_leaf, step_kind, step_size

    def frames(self, batch: RecordBatch, now: float = -1.0) -> list[bytes]:
        """The batch's frames, in order; ``now`` >= 0 sets every record's time (for checks).
        A ValueError for a record whose arrays have other dtypes or shapes than the template's
        (its bytes would not match the packed headers)."""
        return native_frames.frames.frame_records(
            batch.records, batch.start, batch.stop, self.pieces, self.leaf_dtypes,
            self.leaf_shapes, self.step_leaf, self.step_kind, self.step_size, now)


def make_template(batch: RecordBatch, fields: dict[str, Any]) -> FrameTemplate | None:
    """The template for ``batch``'s tap site and device, checked against the general encoder
    on its first record; None when the records must be framed in Python. ``fields`` are the
    record fields that never change: name, metadata, process, host, device, device_id."""
    if native_frames.frames is None:
        _say_once(native_frames.missing)
        return None
    try:
        return _checked_template(batch, fields)
    except Exception:  # noqa: BLE001 - e.g. a pytree node that cannot hold the hole markers:
        return None  # its records are framed in Python, by the general encoder


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logging.getLogger("hostcallback").warning("%s", message)


def _checked_template(batch: RecordBatch, fields: dict[str, Any]) -> FrameTemplate | None:
    consumer, first = batch.consumer, batch.records[batch.start]
    leaves = first[LEAVES]
    if consumer.key_impls or not all(type(leaf) is np.ndarray for leaf in leaves):
        return None
    nonce = uuid.uuid4().hex
    holes = [f"\0hostcallback-hole-{nonce}-{index}" for index in range(len(leaves) + 3)]
    marked = tree_util.tree_unflatten(consumer.treedef, holes[:len(leaves)])
    step_leaf, step_kind, step_size = -1, "i", 8
    if isinstance(marked, dict) and marked.get("step") is not None:
        if marked["step"] not in holes[:len(leaves)]:
            return None
        step_leaf = holes.index(marked["step"])
        step = leaves[step_leaf]
        step_kind, step_size = step.dtype.kind, step.dtype.itemsize
        if step_kind not in _STEP_KINDS or step.size == 0:
            return None
    payload = pack(TapRecord(value=marked, step=holes[-3], sequence=holes[-2], time=holes[-1],
                             transforms=list(batch.transforms), **fields).to_map())
    heads = [_array_head(leaf) for leaf in leaves]  # TypeError: a dtype no reader decodes
    pieces, position = [], 0
    for index, hole in enumerate(holes):
        packed = pack(hole)
        found = payload.find(packed, position)
        if found < 0 or payload.count(packed) != 1:
            return None
        pieces.append(payload[position:found] + (heads[index] if index < len(heads) else b""))
        position = found + len(packed)
    pieces.append(payload[position:])
    template = FrameTemplate(pieces, leaves, step_leaf, step_kind, step_size)
    now = time.time()
    value = consumer.arg_of(leaves)
    expected = frame_item(TapRecord(value=value, step=step_of(value), sequence=first[SEQUENCE],
                                    time=now, transforms=list(batch.transforms),
                                    **fields).to_map())
    first_only = RecordBatch(batch.records, batch.start, batch.start + 1, consumer, batch.device)
    return template if template.frames(first_only, now) == [expected] else None


def _array_head(leaf: np.ndarray) -> bytes:
    """What the general encoder packs for ``leaf`` before its data: the array's map up to and
    including the bin header of its bytes."""
    packed = pack(encode_value(leaf))
    return packed[:len(packed) - leaf.nbytes]
