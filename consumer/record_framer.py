"""The fast path of the record stream: frames of one tap site's records, without a TapRecord.

A RecordFramer packs what never changes between a tap site's records once, and each record's
value, step, sequence number and time around it: the bytes are exactly those of
``frame_item(TapRecord(...).to_map())`` (the general encoder in ``stream``, whose record layout
it reads, so the two cannot drift apart), for a third of the cost. It never decides what a record
holds, and never touches JAX.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from .stream import TapRecord, encode_value, frame, pack, thread_packer

# What to_map's record fields change per record, in to_map's order; RecordFramer packs every
# other field once. ("device" and "device_id" change per device only.)
_VARYING_FIELDS = ("value", "step", "device", "device_id", "sequence", "time", "transforms")
_SMALL_ARRAY_BYTES = 1 << 16  # larger arrays take the general path: their copy is the cost
# (dict key or None, dtype, shape) -> the packed key and encode_value(array) packed, all but
# the array's data: the same for every array of that dtype and shape.
_ARRAY_HEADS: dict[tuple[str | None, np.dtype, tuple[int, ...]], bytes] = {}


def _array_head(key: str | None, array: np.ndarray) -> bytes:
    packed = pack(encode_value(np.zeros(array.shape, array.dtype)))
    head = packed[:len(packed) - array.nbytes]
    if key is not None:
        head = pack(key) + head
    if len(_ARRAY_HEADS) >= 4096:  # shapes and keys that never repeat must not grow it for ever
        _ARRAY_HEADS.clear()
    _ARRAY_HEADS[(key, array.dtype, array.shape)] = head
    return head


def _pack_value(value: Any, parts: list[bytes], packer: msgpack.Packer) -> None:
    """Appends pack(encode_value(value)) to ``parts``, in pieces: small arrays, alone or in
    str-keyed dicts (what taps deliver), without building encode_value's maps; anything else
    as it is."""
    kind = type(value)
    if kind is dict:
        start = len(parts)
        parts.append(packer.pack_map_header(len(value)))
        for key, item in value.items():
            if type(item) is np.ndarray:  # the heads cached are of str keys and small arrays
                head = _ARRAY_HEADS.get((key, item.dtype, item.shape))
                if head is not None:
                    parts.append(head)
                    parts.append(item.tobytes())
                    continue
            if type(key) is not str:  # encode_value's form for other keys
                del parts[start:]
                parts.append(packer.pack(encode_value(value)))
                return
            if type(item) is np.ndarray and item.nbytes <= _SMALL_ARRAY_BYTES \
                    and item.dtype.isnative:  # the head names the dtype; tobytes() keeps its order
                parts.append(_array_head(key, item))
                parts.append(item.tobytes())
            else:
                parts.append(packer.pack(key))
                _pack_value(item, parts, packer)
    elif kind is np.ndarray and value.nbytes <= _SMALL_ARRAY_BYTES and value.dtype.isnative:
        parts.append(_ARRAY_HEADS.get((None, value.dtype, value.shape))
                     or _array_head(None, value))
        parts.append(value.tobytes())
    else:
        parts.append(packer.pack(encode_value(value)))


class RecordFramer:
    """The frames of one tap site's records, byte for byte what ``frame_item(TapRecord(...)
    .to_map())`` gives, for a third of the cost: the fields that never change between records
    (name, metadata, process, host, the field names; a device's name and id; the transforms)
    are packed once, and a value's small arrays go out without encode_value's maps. The record
    layout comes from to_map, so the two cannot drift apart."""

    def __init__(self, name: str, metadata: dict[str, Any], process: int, host: str) -> None:
        fields = TapRecord(name=name, value=None, metadata=metadata, process=process,
                           host=host).to_map()
        varying = tuple(key for key in fields if key in _VARYING_FIELDS)
        if varying != _VARYING_FIELDS:  # _VARYING_FIELDS must follow to_map's order
            raise AssertionError(f"TapRecord.to_map orders its fields {varying}")
        packer = msgpack.Packer(use_bin_type=True)
        constants = [packer.pack_map_header(len(fields))]
        for key, item in fields.items():
            constants[-1] += packer.pack(key)
            if key in _VARYING_FIELDS:
                constants.append(b"")
            else:
                constants[-1] += packer.pack(item)
        # Before value, step, device, device_id, sequence, time, transforms; after transforms.
        (self._head, self._before_step, self._before_device, self._before_device_id,
         self._before_sequence, self._before_time, self._before_transforms,
         self._tail) = constants
        self._devices: dict[int, tuple[str, bytes]] = {}  # device id -> (name, packed)
        self._transforms: tuple[Any, bytes] = (object(), b"")  # the last seen, packed

    def frame(self, value: Any, step: int | None, device: str, device_id: int, sequence: int,
              time: float, transforms: Any) -> bytes:
        packer = thread_packer()
        parts = [self._head]
        _pack_value(value, parts, packer)
        name_and_part = self._devices.get(device_id)
        if name_and_part is None or name_and_part[0] != device:
            name_and_part = self._devices[device_id] = (device, (
                self._before_device + packer.pack(device) + self._before_device_id
                + packer.pack(device_id) + self._before_sequence))
        last, packed_transforms = self._transforms
        if transforms is not last:  # a consumer's transforms are one tuple, passed every time
            packed_transforms = packer.pack([encode_value(t) for t in transforms]) + self._tail
            self._transforms = (transforms, packed_transforms)
        pack = packer.pack
        parts += (self._before_step, pack(step), name_and_part[1], pack(sequence),
                  self._before_time, pack(time), self._before_transforms, packed_transforms)
        return frame(b"".join(parts))
