"""The record stream: tapped values as a versioned msgpack stream, readable from any language.

A stream is a sequence of msgpack maps. The first is a header ``{"format": "hostcallback-stream",
"version": 1, ...}``; each following map is one tap record ("Record stream format" lists its keys).
Arrays travel as ``{"__ndarray__": dtype name, "shape": [...], "data": raw bytes}``, so every
dtype, bfloat16 and the other ml_dtypes included, round-trips bit for bit. Readers skip a torn last
record (a crash mid-write) and keep every complete one before it. This module never touches JAX.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy by name)
import msgpack
import numpy as np

FORMAT = "hostcallback-stream"
VERSION = 1
SUPPORTED_VERSIONS = (1,)

# Over TCP the collector answers with the number of records it has received on the connection
# so far, as one of these, after each batch it writes; the sender forgets what is acknowledged.
ACK = struct.Struct("<Q")

_ARRAY = "__ndarray__"
_TUPLE = "__tuple__"
_DICT = "__dict__"  # a dict whose keys are not all strings


class StreamFormatError(ValueError):
    """Bytes that are not a hostcallback record stream, or a version this reader does not know."""


@dataclasses.dataclass
class TapRecord:
    """One tapped value with everything a reader needs to know where it came from."""

    name: str
    value: Any
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    step: int | None = None
    process: int = 0
    host: str = ""
    device: str = ""
    device_id: int = -1
    sequence: int = -1
    time: float = 0.0
    transforms: list = dataclasses.field(default_factory=list)
    source: str = ""  # set by the collector: which connection the record came through

    def to_map(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["value"] = encode_value(self.value)
        fields["metadata"] = encode_value(self.metadata)
        fields["transforms"] = [encode_value(t) for t in self.transforms]
        return fields

    @classmethod
    def from_map(cls, fields: dict[str, Any]) -> TapRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in fields.items() if k in known}  # newer writers may add keys
        fields["value"] = decode_value(fields.get("value"))
        fields["metadata"] = decode_value(fields.get("metadata") or {})
        fields["transforms"] = [decode_value(t) for t in fields.get("transforms") or []]
        return cls(**fields)


def encode_value(value: Any) -> Any:
    """A pytree of arrays, numbers, strings and containers as msgpack-ready data."""
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value, order="C")
        return {_ARRAY: array.dtype.name, "shape": list(array.shape), "data": array.tobytes()}
    if isinstance(value, tuple):
        return {_TUPLE: [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode_value(v) for k, v in value.items()}
        return {_DICT: [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if hasattr(value, "__array__"):  # a jax.Array reached a sink: store its values
        return encode_value(np.asarray(value))
    return repr(value)


def decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if _ARRAY in value:
            dtype = np.dtype(value[_ARRAY])
            return np.frombuffer(value["data"], dtype=dtype).reshape(value["shape"]).copy()
        if _TUPLE in value:
            return tuple(decode_value(v) for v in value[_TUPLE])
        if _DICT in value:
            return {_hashable(decode_value(k)): decode_value(v) for k, v in value[_DICT]}
        return {k: decode_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value


def _hashable(key):
    return key.item() if isinstance(key, np.ndarray) and key.ndim == 0 else key


def stream_header(**extra: Any) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "host": socket.gethostname(),
            "pid": os.getpid(), "created": time.time(), **extra}


def pack(item: dict[str, Any]) -> bytes:
    return msgpack.packb(item, use_bin_type=True)


class StreamWriter:
    """Writes a header, then one packed record per write(); the caller owns the file."""

    def __init__(self, file: BinaryIO, write_header: bool = True, **header: Any) -> None:
        self.file = file
        if write_header:
            file.write(pack(stream_header(**header)))

    def write(self, record: TapRecord) -> int:
        data = pack(record.to_map())
        self.file.write(data)
        return len(data)


def check_header(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("format") != FORMAT:
        raise StreamFormatError("not a hostcallback record stream (no stream header found)")
    if item.get("version") not in SUPPORTED_VERSIONS:
        raise StreamFormatError(f"stream version {item.get('version')} is not supported "
                                f"(this reader knows {SUPPORTED_VERSIONS})")
    return item


class StreamReader:
    """Reads records from bytes fed in pieces (a file being followed, a socket).

    Headers may recur (a rotated or concatenated stream); each is checked. Incomplete bytes wait
    for more; ``feed`` never raises for a record that is merely cut short.
    """

    def __init__(self, max_buffer_size: int = 1 << 30) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max_buffer_size,
                                          strict_map_key=False)
        self.header: dict[str, Any] | None = None

    def feed(self, data: bytes) -> list[TapRecord]:
        self._unpacker.feed(data)
        records = []
        try:
            for item in self._unpacker:
                if isinstance(item, dict) and item.get("format") == FORMAT:
                    self.header = check_header(item)
                    continue
                if self.header is None:
                    raise StreamFormatError("stream does not start with a hostcallback header")
                if not isinstance(item, dict) or "name" not in item:
                    raise StreamFormatError(f"unexpected item in the stream: {type(item).__name__}")
                records.append(TapRecord.from_map(item))
        except StreamFormatError:
            raise
        except Exception as error:  # msgpack's errors, or a record whose fields do not decode
            raise StreamFormatError(
                f"corrupt record stream: {type(error).__name__}: {error}") from error
        return records


def read_records(path_or_file) -> Iterator[TapRecord]:
    """Every complete record of a stream file, in order; a torn last record is skipped."""
    file = open(path_or_file, "rb") if isinstance(path_or_file, (str, os.PathLike)) else path_or_file
    try:
        reader = StreamReader()
        while True:
            chunk = file.read(1 << 20)
            if not chunk:
                return
            yield from reader.feed(chunk)
    finally:
        if file is not path_or_file:
            file.close()


def dumps(records: list[TapRecord], **header: Any) -> bytes:
    """A whole stream in memory (tests and small tools)."""
    out = io.BytesIO()
    writer = StreamWriter(out, **header)
    for record in records:
        writer.write(record)
    return out.getvalue()
