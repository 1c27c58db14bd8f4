"""The record stream: tapped values as a versioned, framed msgpack stream, readable anywhere.

A stream is a sequence of frames (version 2): a 4-byte sync marker, the payload's length and CRC-32,
then one msgpack map. The first map is a header ``{"format": "hostcallback-stream", "version": 2,
...}``; each following map is one tap record ("Record stream format" lists its keys). Arrays travel
as ``{"__ndarray__": dtype name, "shape": [...], "data": raw bytes}``, so every dtype, bfloat16 and
the other ml_dtypes included, round-trips bit for bit.

Readers keep every intact record: after damage they resynchronise at the next sync marker and
report the skipped byte range; a torn last record (a crash mid-write) is reported the same way.
Version-1 streams (plain msgpack maps, no frames) are read too. This module never touches JAX.

Beside it: ``record_framer`` (a tap site's frames packed fast, byte for byte these), and
``stream_files`` (a stream's files: reading them whole, rotated, or following a growing one).
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy by name)
import msgpack
import numpy as np

FORMAT = "hostcallback-stream"
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)

# Every item of a version-2 stream is framed: SYNC, payload length, CRC-32 of the payload (both
# little-endian uint32), payload. 0xc1 never starts a msgpack value, so a version-1 reader stops
# at once, and after damage a reader finds the next frame by searching for SYNC.
SYNC = b"\xc1hcb"
FRAME = struct.Struct("<4sII")
# A record's msgpack holds a handful of containers (its fields, the leaves of its pytree): one of
# more elements than this is damage or an attack, and decoding it would cost memory many times
# its bytes ([{}] * 4_000_000 fits in a 3.8 MiB frame and took 527 MiB as Python objects).
MSGPACK_LIMITS = {"max_array_len": 1 << 16, "max_map_len": 1 << 16}
# Every version-1 record written by TapRecord.to_map starts with these bytes (a 12-entry map whose
# first key is "name"): where version-1 readers resynchronise.
_V1_RECORD = b"\x8c\xa4name"
# A record's map starts with its first key, "name" (TapRecord.to_map writes it first): how a record
# frame is told from a header without decoding it.
RECORD_START = b"\xa4name"

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
        # Not dataclasses.asdict: it deep-copies every value first (most of a record's cost).
        # Spelled out (not a loop over the fields): this runs once per record written.
        return {"name": self.name, "value": encode_value(self.value),
                "metadata": encode_value(self.metadata) if self.metadata else {},
                "step": self.step, "process": self.process, "host": self.host,
                "device": self.device, "device_id": self.device_id, "sequence": self.sequence,
                "time": self.time, "transforms": [encode_value(t) for t in self.transforms],
                "source": self.source}

    @classmethod
    def from_map(cls, fields: dict[str, Any]) -> TapRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in fields.items() if k in known}  # newer writers may add keys
        fields["value"] = decode_value(fields.get("value"))
        fields["metadata"] = decode_value(fields.get("metadata") or {})
        fields["transforms"] = [decode_value(t) for t in fields.get("transforms") or []]
        return cls(**fields)


_RECORD_FIELDS = tuple(field.name for field in dataclasses.fields(TapRecord))  # "name" first


_DTYPE_NAMES: dict[np.dtype, str] = {}  # dtype.name costs microseconds; records repeat dtypes


def _dtype_name(dtype: np.dtype) -> str:
    """The name a reader decodes ``dtype`` from, in native byte order (the data is written so);
    a TypeError for a dtype that no name describes."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = _decodable_name(dtype)
    return name


def _decodable_name(dtype: np.dtype) -> str:
    native = dtype.newbyteorder("=")
    # Strings need their length and byte order ("<U2"); every other dtype is known by its name
    # (which also names bfloat16 and friends, registered by ml_dtypes).
    name = native.str if native.kind in "US" else native.name
    try:
        decodable = native.kind != "O" and np.dtype(name) == native
    except TypeError:
        decodable = False
    if not decodable:
        raise TypeError(
            f"cannot record an array of dtype {dtype}: a reader could not decode its bytes "
            "(object arrays hold pointers, structured arrays lose their fields). Tap numbers, "
            "booleans, dates or strings: one array per field of a structured array, or "
            "np.asarray(values, dtype=str) for objects.")
    return name


def _array_data(array: np.ndarray) -> bytes:
    """The array's bytes in C order and native byte order (what _dtype_name names)."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return array.tobytes()


def encode_value(value: Any) -> Any:
    """A pytree of arrays, numbers, strings and containers as msgpack-ready data."""
    kind = type(value)
    # Exact-type fast paths for what taps deliver (arrays in str-keyed dicts); tobytes() is
    # C order whatever the layout, so an ndarray needs no copy first.
    if kind is np.ndarray:
        return {_ARRAY: _dtype_name(value.dtype), "shape": list(value.shape),
                "data": _array_data(value)}
    if kind is dict and all(type(k) is str for k in value):
        return {k: encode_value(v) for k, v in value.items()}
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value, order="C")
        return {_ARRAY: _dtype_name(array.dtype), "shape": list(array.shape),
                "data": _array_data(array)}
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


def unpack_item(payload: bytes) -> Any:
    """A frame's msgpack value, within MSGPACK_LIMITS (ValueError past them)."""
    return msgpack.unpackb(payload, raw=False, strict_map_key=False, **MSGPACK_LIMITS)


def stream_header(**extra: Any) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "host": socket.gethostname(),
            "pid": os.getpid(), "created": time.time(), **extra}


_packers = threading.local()  # a Packer per thread: packb makes a new one per call


def thread_packer() -> msgpack.Packer:
    """This thread's Packer (a Packer is not thread-safe)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer


def pack(item: Any) -> bytes:
    return thread_packer().pack(item)


def frame(payload: bytes) -> bytes:
    """One version-2 frame around an already packed msgpack value."""
    return FRAME.pack(SYNC, len(payload), zlib.crc32(payload)) + payload


def frame_item(item: dict[str, Any]) -> bytes:
    """A header or record map, packed and framed: what writers append, one whole frame per write."""
    return frame(pack(item))


class StreamWriter:
    """Writes a header, then one framed record per write(); the caller owns the file."""

    def __init__(self, file: BinaryIO, write_header: bool = True, **header: Any) -> None:
        self.file = file
        if write_header:
            file.write(frame_item(stream_header(**header)))

    def write(self, record: TapRecord) -> int:
        data = frame_item(record.to_map())
        self.file.write(data)
        return len(data)


def check_header(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("format") != FORMAT:
        raise StreamFormatError("not a hostcallback record stream (no stream header found)")
    if item.get("version") not in SUPPORTED_VERSIONS:
        raise StreamFormatError(f"stream version {item.get('version')} is not supported "
                                f"(this reader knows {SUPPORTED_VERSIONS})")
    return item


@dataclasses.dataclass(frozen=True)
class SkippedRange:
    """Bytes ``[start, end)`` of a stream that held no intact record, and why."""

    start: int
    end: int
    reason: str

    def __str__(self) -> str:
        return (f"skipped bytes {self.start}-{self.end} ({self.end - self.start} bytes): "
                f"{self.reason}")


class _Damaged(Exception):
    """An item that is not intact; the reader skips it and resynchronises."""


class StreamReader:
    """Reads records from bytes fed in pieces (a file being followed, a socket).

    Headers may recur (a rotated, concatenated or collected stream); each is checked. Incomplete
    bytes wait for more; ``feed`` never raises for a record that is merely cut short, nor for
    damage after the header: the damaged bytes are skipped up to the next intact frame and
    recorded in ``skipped`` (and passed to ``on_skip``). Call ``finish()`` at the end of the data
    to resynchronise past a damaged length and to report a torn last record.

    ``following``: the bytes are a growing file or a socket, whose end may never come. A frame
    that claims to run past an intact frame is then taken for a damaged length at once, rather
    than waited for. Reading whole data (read_records) passes False: an intact record may carry
    frame bytes in its payload (a tapped byte buffer), and only finish() may declare damage.
    """

    def __init__(self, max_buffer_size: int = 1 << 30,
                 on_skip: Callable[[SkippedRange], None] | None = None,
                 following: bool = True) -> None:
        self.max_item_bytes = max_buffer_size
        self.on_skip = on_skip
        self.following = following
        self.header: dict[str, Any] | None = None
        self.skipped: list[SkippedRange] = []
        self._buffer = bytearray()
        self._base = 0  # stream offset of _buffer[0]
        self._version: int | None = None  # 1: plain msgpack items, 2: frames
        self._damage: tuple[int, str] | None = None  # (start offset, reason) while skipping
        self._source = ""  # the collector's segment header names the source of what follows
        self._searched = (-1, 0)  # (frame offset, offset searched to) for _intact_frame_within

    def feed(self, data: bytes) -> list[TapRecord]:
        self._buffer += data
        return self._parse(final=False)

    @property
    def next_frame_at(self) -> int:
        """Where the bytes fed that no record was taken from yet start (a frame boundary)."""
        return self._base

    def cut_back(self, size: int) -> None:
        """The data was cut back to ``size`` bytes (a writer undoing a write the disk took only
        in part): the bytes fed past it that no record was taken from are dropped, and what is
        fed next continues from ``size``."""
        if size >= self._base + len(self._buffer):
            return
        del self._buffer[max(0, size - self._base):]
        self._base = min(self._base, size)
        if self._damage is not None and self._damage[0] >= size:
            self._damage = None
        self._searched = (-1, 0)

    def finish(self) -> list[TapRecord]:
        """The records left in what was fed; reports a torn or damaged end as skipped."""
        records = self._parse(final=True)
        if self._buffer or self._damage is not None:
            end = self._base + len(self._buffer)
            start, reason = self._damage if self._damage is not None else (self._base, "")
            self._damage = None
            self._report(start, end, reason or "torn last record (the writer stopped mid-write)")
            self._base, self._buffer = end, bytearray()
        return records

    # ---- parsing ----

    def _report(self, start: int, end: int, reason: str) -> None:
        if end > start:
            skipped = SkippedRange(start, end, reason)
            self.skipped.append(skipped)
            if self.on_skip is not None:
                self.on_skip(skipped)

    def _mark_damaged(self, position: int, reason: str) -> None:
        if self._version is None:
            if not (self._base == 0 and self._buffer.startswith(SYNC)):
                raise StreamFormatError(f"stream does not start with a hostcallback header "
                                        f"({reason})")
            self._version = 2  # a framed stream whose header is damaged: its records still count
        if self._damage is None:
            self._damage = (self._base + position, reason)

    def _intact_at(self, position: int) -> None:
        if self._damage is not None:
            start, reason = self._damage
            self._damage = None
            self._report(start, self._base + position, reason)

    def _resync(self, start: int) -> int | None:
        """Where the next frame (or, in a version-1 stream, record) may start, from ``start``."""
        found = self._buffer.find(SYNC, start)
        if self._version == 1:
            v1 = self._buffer.find(_V1_RECORD, start, found if found >= 0 else len(self._buffer))
            if v1 >= 0:
                return v1
        return found if found >= 0 else None

    def _parse(self, final: bool) -> list[TapRecord]:
        records: list[TapRecord] = []
        buffer, position = self._buffer, 0
        while position < len(buffer):
            try:
                if len(buffer) - position < len(SYNC) and SYNC.startswith(buffer[position:]):
                    used = 0  # maybe the start of a frame
                elif buffer.startswith(SYNC, position):
                    used = self._parse_frame(position, records)
                elif self._damage is None and self._version != 2 or (
                        self._version == 1 and buffer.startswith(_V1_RECORD, position)):
                    used = self._parse_plain(position, records)
                else:  # skipping damage: look for the next frame
                    used = -1
                if used == 0:  # incomplete: wait for more bytes, or at the end it is damage
                    if not final:
                        break
                    raise _Damaged("incomplete item followed by more data"
                                   if self._resync(position + 1) is not None
                                   else "torn last record (the writer stopped mid-write)")
                if used > 0:
                    self._intact_at(position)
                    position += used
                    continue
                self._mark_damaged(position, "no frame starts here")
            except _Damaged as damage:
                self._mark_damaged(position, str(damage))
            following = self._resync(position + 1)
            if following is None:  # keep a tail that may hold the start of a sync marker
                position = max(position + 1, len(buffer) - len(SYNC) + 1)
                if final:
                    position = len(buffer)
                break
            position = following
        del buffer[:position]
        self._base += position
        return records

    def _parse_frame(self, position: int, records: list[TapRecord]) -> int:
        buffer = self._buffer
        if len(buffer) - position < FRAME.size:
            return 0
        _, length, crc = FRAME.unpack_from(buffer, position)
        if length > self.max_item_bytes:
            raise _Damaged(f"frame length {length} is over the limit of {self.max_item_bytes}")
        end = position + FRAME.size + length
        if end > len(buffer):
            if self.following and self._intact_frame_within(position, end):
                raise _Damaged(f"frame length {length} runs past an intact frame (a damaged "
                               "length field)")
            return 0  # wait for the rest
        payload = bytes(buffer[position + FRAME.size:end])
        if zlib.crc32(payload) != crc:
            raise _Damaged("CRC-32 does not match the frame's contents")
        try:
            item = unpack_item(payload)
        except Exception as error:
            raise _Damaged(f"frame holds no msgpack value: {error}") from error
        self._version = self._version or 2
        self._take(item, records)
        return end - position

    def _intact_frame_within(self, position: int, end: int) -> bool:
        """Whether a whole, CRC-valid frame lies inside the incomplete frame at ``position``
        (which claims to end at ``end``): then its length is damaged, and a follower must not
        wait for bytes that never come. Each byte is searched once however often this is asked."""
        buffer = self._buffer
        frame_at = self._base + position
        search = position + FRAME.size
        if self._searched[0] == frame_at:
            search = max(search, self._searched[1] - self._base)
        while True:
            found = buffer.find(SYNC, search, min(end, len(buffer)))
            if found < 0:
                self._searched = (frame_at, self._base + max(search, len(buffer) - len(SYNC) + 1))
                return False
            if len(buffer) - found < FRAME.size:
                self._searched = (frame_at, self._base + found)
                return False
            _, length, crc = FRAME.unpack_from(buffer, found)
            inner_end = found + FRAME.size + length
            if 0 < length and inner_end <= end:  # a frame that could lie inside it
                if inner_end > len(buffer):
                    self._searched = (frame_at, self._base + found)  # look again with more bytes
                    return False
                with memoryview(buffer)[found + FRAME.size:inner_end] as payload:
                    if zlib.crc32(payload) == crc:
                        return True
            search = found + 1

    def _parse_plain(self, position: int, records: list[TapRecord]) -> int:
        """Version-1 items (bare msgpack maps) from ``position``, up to the next frame or damage;
        the bytes they used (0: the first is incomplete)."""
        rest = bytes(self._buffer[position:])
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                    max_buffer_size=max(len(rest), 1), **MSGPACK_LIMITS)
        unpacker.feed(rest)
        used = 0
        while used < len(rest) and not rest.startswith(SYNC, used):
            try:
                item = unpacker.unpack()
                if self._version is None:
                    if not (isinstance(item, dict) and item.get("format") == FORMAT):
                        raise StreamFormatError("stream does not start with a hostcallback header")
                    self._version = 1
                self._take(item, records)
            except msgpack.OutOfData:
                break
            except (StreamFormatError, _Damaged):
                if used:
                    break
                raise
            except Exception as error:
                if used:
                    break
                raise _Damaged(f"corrupt record stream: {type(error).__name__}: {error}") from error
            used = unpacker.tell()
        return used

    def _take(self, item: Any, records: list[TapRecord]) -> None:
        if isinstance(item, dict) and item.get("format") == FORMAT:
            self.header = check_header(item)  # a version this reader does not know: refused
            self._source = str(item.get("source", ""))
            return
        if not isinstance(item, dict) or "name" not in item:
            raise _Damaged(f"unexpected item in the stream: {type(item).__name__}")
        try:
            record = TapRecord.from_map(item)
        except Exception as error:  # fields that do not decode
            raise _Damaged(f"record does not decode: {type(error).__name__}: {error}") from error
        if not record.source:
            record.source = self._source
        records.append(record)


def dumps(records: list[TapRecord], **header: Any) -> bytes:
    """A whole stream in memory (tests and small tools)."""
    out = io.BytesIO()
    writer = StreamWriter(out, **header)
    for record in records:
        writer.write(record)
    return out.getvalue()
