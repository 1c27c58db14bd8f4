"""The collector's run files: appending whole frames, and reading back what a file holds.

A run file is a record stream whose records come in segments: a segment header (``source``,
``sender``, ``first``) precedes the records of each batch unless they continue the previous
segment. ``scan_run_file`` rebuilds from those headers, after a restart, how many records of each
sender the file holds, so a record sent again is written once. Nothing here writes part of a
frame: a write that the file takes only in part raises, and the caller cuts it off again.
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from typing import Any, BinaryIO

from .stream import (
    FORMAT,
    FRAME,
    RECORD_START,
    SYNC,
    VERSION,
    frame_item,
    stream_header,
    unpack_item,
)


class RunFile:
    """One open run file and the segment that its last bytes belong to."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: BinaryIO = open(path, "ab", buffering=0)  # noqa: SIM115 (kept open, LRU)
        self.segment: tuple[str, int] | None = None  # (sender, next sequence) of the last write


def write_all(file: BinaryIO, data: bytes) -> None:
    """Writes every byte of ``data`` or raises OSError: an unbuffered write may take only part of
    it (a full disk, a quota, RLIMIT_FSIZE) and say so only in its return value."""
    with memoryview(data) as view:
        written = 0
        while written < len(view):
            count = file.write(view[written:])
            if not count:
                raise OSError(errno.ENOSPC, "the file took none of the bytes written")
            written += count


def file_header(run: str) -> bytes:
    """The framed header a new run file starts with."""
    return frame_item(stream_header(run=run, collected=True))


def segment_header(run: str, source: str, sender: str, first: int) -> bytes:
    """The framed header of a segment: the records after it came from ``sender`` through
    ``source``, numbered from ``first``."""
    return frame_item({"format": FORMAT, "version": VERSION, "run": run, "source": source,
                       "sender": sender, "first": first})


def scan_run_file(path: str) -> tuple[dict[str, int], int, bool]:
    """What a run file holds: per sender the next sequence number it has not written, the end of
    its last intact frame, and whether it is a framed (version-2) file at all."""
    senders: dict[str, int] = {}
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return senders, 0, True
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            framed = data[:len(SYNC)] == SYNC
            position, intact_end, segment = 0, 0, None
            while position < size:
                if data[position:position + len(SYNC)] != SYNC or position + FRAME.size > size:
                    position = data.find(SYNC, position + 1)
                    if position < 0:
                        break
                    continue
                _, length, crc = FRAME.unpack_from(data, position)
                end = position + FRAME.size + length
                with memoryview(data)[position + FRAME.size:min(end, size)] as payload:
                    intact = end <= size and zlib.crc32(payload) == crc
                    if intact and bytes(payload[1:6]) != RECORD_START:  # a header
                        header = _unpack(payload)
                        if isinstance(header, dict) and header.get("format") == FORMAT:
                            sender = header.get("sender")
                            segment = sender if isinstance(sender, str) else None
                            if segment is not None:
                                senders[segment] = max(senders.get(segment, 0),
                                                       int(header.get("first", 0)))
                    elif intact and segment is not None:
                        senders[segment] += 1
                if not intact:
                    position = data.find(SYNC, position + 1)
                    if position < 0:
                        break
                    continue
                position = intact_end = end
    return senders, intact_end, framed


def _unpack(payload) -> Any:
    try:
        return unpack_item(payload)
    except Exception:  # noqa: BLE001 (any undecodable header is simply not one)
        return None
