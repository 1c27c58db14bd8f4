"""The binary layout of one tap record, read by Python (the constants are the C++ core's own).

A record is a 64-byte aligned block: a fixed 48-byte header, one descriptor per array, zero padding
to a multiple of 64, then each array's bytes, each starting 64-byte aligned. The document "Wire
format of one tap record" shows it byte by byte. Decoding never trusts the bytes: every count,
size and offset is checked against the buffer before an array view is made, so corrupt input
raises WireFormatError.
"""

from __future__ import annotations

import dataclasses
import struct

import ml_dtypes
import numpy as np

from hostcallback._native import outfeed
from hostcallback.errors import UnsupportedDtypeError, WireFormatError

MAGIC = outfeed.WIRE_MAGIC  # the bytes b"HCB1"
VERSION = outfeed.WIRE_VERSION
ALIGNMENT = outfeed.WIRE_ALIGNMENT
# magic version flags consumer device count seq hdr rsv size
FIXED_HEADER = struct.Struct("<IHHQIIQIIQ")
DESCRIPTOR = struct.Struct("<BBHIQ")  # dtype reserved ndim reserved byte_size, then int64 dims
FLAG_EXPECTS_RESPONSE = outfeed.FLAG_EXPECTS_RESPONSE  # a `call`: the device waits for the answer
# A tap or call made from Python: its arrays (and a call's answer) are handed over there
# (handover.py).
FLAG_HANDED_OVER_IN_PYTHON = outfeed.FLAG_HANDED_OVER_IN_PYTHON
# The structs above spell out the C++ core's layout field by field; their sizes must be its.
assert FIXED_HEADER.size == outfeed.WIRE_FIXED_HEADER_BYTES
assert DESCRIPTOR.size == outfeed.WIRE_DESCRIPTOR_BYTES

# Codes are XLA's PrimitiveType numbers, which the FFI hands the handler as the element type;
# the table is the core's (constants.h), by numpy's and ml_dtypes' names.
DTYPE_BY_CODE: dict[int, np.dtype] = {
    code: np.dtype(getattr(ml_dtypes, name, None) or name)
    for code, name in sorted(outfeed.WIRE_DTYPES.items())}
CODE_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}


MAX_NDIM = outfeed.WIRE_MAX_NDIM  # numpy's limit: a tapped array must become one on the host


def dtype_code(dtype) -> int:
    """The wire code of a dtype, or UnsupportedDtypeError naming the dtypes that can be tapped."""
    dtype = np.dtype(dtype)
    try:
        return CODE_BY_DTYPE[dtype]
    except KeyError:
        names = ", ".join(sorted(str(d) for d in CODE_BY_DTYPE))
        raise UnsupportedDtypeError(
            f"dtype {dtype} cannot be tapped; supported dtypes are: {names}") from None


def as_leaf(array) -> tuple[int, list[int], np.ndarray]:
    """One array as the C++ core's ``enqueue`` and ``call`` take it: (dtype code, shape, bytes)."""
    array = np.asarray(array, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
    return dtype_code(array.dtype), list(array.shape), array.reshape(-1).view(np.uint8)


@dataclasses.dataclass(frozen=True)
class Record:
    """One decoded tap: who it is for, where it came from, and its arrays (views, not copies)."""

    consumer_id: int
    device: int
    sequence: int
    arrays: tuple[np.ndarray, ...]
    flags: int = 0

    @property
    def expects_response(self) -> bool:
        return bool(self.flags & FLAG_EXPECTS_RESPONSE)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def decode_record(buffer) -> Record:
    """Decodes one record; the arrays are read-only views into ``buffer``."""
    data = np.frombuffer(buffer, dtype=np.uint8)
    size = data.size
    if size < FIXED_HEADER.size:
        raise WireFormatError(
            f"record of {size} bytes is shorter than the {FIXED_HEADER.size}-byte header")
    (magic, version, flags, consumer_id, device, count, sequence, header_size, _reserved,
     record_size) = FIXED_HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireFormatError(f"bad magic {magic:#x}; expected {MAGIC:#x} (b'HCB1')")
    if version != VERSION:
        raise WireFormatError(
            f"wire version {version} is not supported (this reader knows {VERSION})")
    if record_size != size:
        raise WireFormatError(f"record says it has {record_size} bytes but {size} were given")
    if header_size > size or header_size % ALIGNMENT:
        raise WireFormatError(
            f"header size {header_size} is not a 64-byte multiple within the record")
    # Each descriptor takes at least DESCRIPTOR.size bytes, which bounds the count before any loop.
    if count > (header_size - FIXED_HEADER.size) // DESCRIPTOR.size:
        raise WireFormatError(f"{count} arrays cannot fit in a {header_size}-byte header")
    arrays = []
    at = FIXED_HEADER.size
    offset = header_size
    for index in range(count):
        if at + DESCRIPTOR.size > header_size:
            raise WireFormatError(f"descriptor {index} runs past the header")
        code, _, ndim, _, byte_size = DESCRIPTOR.unpack_from(data, at)
        at += DESCRIPTOR.size
        if ndim > MAX_NDIM or at + 8 * ndim > header_size:
            raise WireFormatError(f"descriptor {index} has an impossible rank {ndim}")
        dims = struct.unpack_from(f"<{ndim}q", data, at)
        at += 8 * ndim
        dtype = DTYPE_BY_CODE.get(code)
        if dtype is None:
            raise WireFormatError(f"array {index} has unknown dtype code {code}")
        if any(d < 0 for d in dims):
            raise WireFormatError(f"array {index} has a negative dimension {dims}")
        offset = _align(offset)
        if byte_size > size - offset:
            raise WireFormatError(f"array {index} ({byte_size} bytes) runs past the record end")
        elements = byte_size // dtype.itemsize
        if elements * dtype.itemsize != byte_size or int(np.prod(dims, dtype=object)) != elements:
            raise WireFormatError(
                f"array {index}: {byte_size} bytes do not hold {dtype}{list(dims)}")
        view = data[offset:offset + byte_size].view(dtype).reshape(dims)
        view.flags.writeable = False
        arrays.append(view)
        offset += byte_size
    return Record(consumer_id, device, sequence, tuple(arrays), flags)


def encode_record(consumer_id: int, device: int, sequence: int, arrays, flags: int = 0) -> bytes:
    """The Python twin of the C++ encoder: for tests, fuzzing and readers in other tools."""
    arrays = [np.asarray(a, order="C") for a in arrays]  # 0-d stays 0-d
    header_size = FIXED_HEADER.size + sum(DESCRIPTOR.size + 8 * a.ndim for a in arrays)
    header_size = _align(header_size)
    size = header_size
    for a in arrays:
        size = _align(size) + a.nbytes
    size = _align(max(size, ALIGNMENT))
    out = bytearray(size)
    FIXED_HEADER.pack_into(out, 0, MAGIC, VERSION, flags, consumer_id, device, len(arrays),
                           sequence, header_size, 0, size)
    at, offset = FIXED_HEADER.size, header_size
    for a in arrays:
        DESCRIPTOR.pack_into(out, at, dtype_code(a.dtype), 0, a.ndim, 0, a.nbytes)
        struct.pack_into(f"<{a.ndim}q", out, at + DESCRIPTOR.size, *a.shape)
        at += DESCRIPTOR.size + 8 * a.ndim
        offset = _align(offset)
        out[offset:offset + a.nbytes] = a.tobytes()
        offset += a.nbytes
    return bytes(out)
