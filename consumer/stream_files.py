"""A record stream's files: read one whole, list and read a rotated set, or follow a growing one.

``FileSink`` rotates ``path`` to ``path.1``, ``path.2``, ... past its size limit; the readers here
take a stream and its rotated files oldest first, and ``follow_records`` (what ``tail --follow``
uses) keeps reading a file as it grows and follows it through rotations. A stream at an fsspec
URL is its parts, in order (``storage``), and is followed part by part. ``expand_streams`` turns
globs (local or URL) into streams, and ``merged_records`` reads many streams as one. Damage is
skipped and reported as the StreamReader in ``stream`` finds it. This module never writes a
stream.
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO

from . import storage
from .stream import SkippedRange, StreamReader, TapRecord

logger = logging.getLogger("hostcallback.stream")


def _warn_skipped(name: str) -> Callable[[SkippedRange], None]:
    def report(skipped: SkippedRange) -> None:
        logger.warning("%s: %s; every intact record before and after it is kept", name, skipped)
    return report


def read_records(path_or_file, skipped: list[SkippedRange] | None = None) -> Iterator[TapRecord]:
    """Every intact record of a stream file, in order.

    Damaged regions and a torn last record are skipped; each skipped byte range is appended to
    ``skipped`` if given, else logged as a warning on ``hostcallback.stream``.
    """
    opened = isinstance(path_or_file, (str, os.PathLike))
    if opened and storage.is_url(os.fspath(path_or_file)):
        file = storage.open_url(os.fspath(path_or_file))
    else:
        file = open(path_or_file, "rb") if opened else path_or_file  # noqa: SIM115
    name = os.fspath(path_or_file) if file is not path_or_file else getattr(file, "name", "stream")
    reader = StreamReader(on_skip=skipped.append if skipped is not None else _warn_skipped(name),
                          following=False)
    try:
        while True:
            chunk = file.read(1 << 20)
            if not chunk:
                break
            yield from reader.feed(chunk)
        yield from reader.finish()
    finally:
        if file is not path_or_file:
            file.close()


def stream_files(path: str | os.PathLike) -> list[str]:
    """A stream's files, oldest first: ``path.N`` ... ``path.1`` (rotated by FileSink), ``path``;
    at a URL, its parts."""
    path = os.fspath(path)
    if storage.is_url(path):
        return storage.stream_parts(path, fresh=True) or [path]
    directory, base = os.path.split(path)
    pattern = re.compile(re.escape(base) + r"\.(\d+)$")
    rotated = []
    for entry in os.listdir(directory or "."):
        match = pattern.match(entry)
        if match:
            rotated.append((int(match.group(1)), os.path.join(directory, entry)))
    files = [name for _, name in sorted(rotated, reverse=True)]
    if os.path.exists(path) or not files:
        files.append(path)
    return files


def read_stream(path: str | os.PathLike,
                skipped: list[SkippedRange] | None = None) -> Iterator[TapRecord]:
    """Every intact record of a stream and its rotated files, oldest first."""
    for name in stream_files(path):
        yield from read_records(name, skipped)


def _listing(path: str) -> list[tuple[str, int]] | None:
    try:
        return [(name, os.stat(name).st_ino) for name in stream_files(path)]
    except FileNotFoundError:  # a rotation is renaming files right now
        return None


def _modified(name: str) -> int:
    try:
        return os.stat(name).st_mtime_ns
    except FileNotFoundError:
        return -1


def _open_next(path: str, inode: int, last_written: int) -> BinaryIO:
    """The file written after the one with ``inode`` (last written at ``last_written``, in ns),
    once ``path`` rotated (maybe many times) or that file was deleted."""
    while True:
        listing = _listing(path)
        if listing is None or listing != _listing(path):  # only a listing that holds still
            time.sleep(0.01)
            continue
        inodes = [number for _, number in listing]
        if inode in inodes:
            index = inodes.index(inode) + 1
        else:  # rotated away, or deleted by someone else: the oldest written since
            index = next((i for i, (name, _) in enumerate(listing)
                          if _modified(name) >= last_written), len(listing) - 1)
        name, expected = listing[min(index, len(listing) - 1)]
        try:
            file = open(name, "rb")  # noqa: SIM115 (the caller owns it)
        except FileNotFoundError:
            continue
        if os.fstat(file.fileno()).st_ino == expected:
            return file
        file.close()


# How far back a follower checks that what it read is still on disk: a writer that cuts its
# file back (undoing a write the disk took only in part) cuts within its last write.
_CHECKED_BYTES = 1 << 20


class _ReadWindow:
    """The bytes a follower read lately, from a frame boundary on (at least _CHECKED_BYTES of
    them, when there are): where the file was cut back and written again, the first byte on
    disk that differs from them says where reading goes on."""

    def __init__(self, start: int = 0, data: bytes = b"") -> None:
        self.boundaries = collections.deque([start])  # frame boundaries, the first its start
        self.keys: collections.deque[set] = collections.deque()  # of the records after each
        self.data = bytearray(data)

    @property
    def start(self) -> int:
        return self.boundaries[0]

    def add(self, chunk: bytes, boundary: int, records: list[TapRecord]) -> None:
        """``chunk`` read and ``records`` taken from it, after which ``boundary`` is where the
        reader's next frame starts."""
        self.data += chunk
        self.boundaries.append(boundary)
        self.keys.append({_key(record) for record in records})
        end = self.start + len(self.data)
        while len(self.boundaries) > 1 and end - self.boundaries[1] > _CHECKED_BYTES:
            self.boundaries.popleft()
            self.keys.popleft()
        del self.data[:self.start - (end - len(self.data))]

    def changed_on(self, file: BinaryIO) -> bool:
        """Whether the file no longer holds these bytes (its first 4 KiB and last
        _CHECKED_BYTES are compared: a cut written over differs where it was cut)."""
        tail = max(0, len(self.data) - _CHECKED_BYTES)
        fd = file.fileno()
        return (os.pread(fd, min(4096, len(self.data)), self.start) != self.data[:4096]
                or os.pread(fd, len(self.data) - tail, self.start + tail) != self.data[tail:])

    def read_on_from_the_cut(self, file: BinaryIO,
                             reader: StreamReader) -> tuple[_ReadWindow, set]:
        """Takes ``reader`` and ``file`` back to where the file first differs from what was
        read; the records of the frames before it, already yielded, are read again and
        dropped. Returns the window from there, and the keys of the records yielded from
        what was cut off (a writer that writes them again, as the collector does, should not
        have them yielded twice)."""
        on_disk = os.pread(file.fileno(), len(self.data), self.start)
        same = on_disk[:len(os.path.commonprefix([on_disk, bytes(self.data)]))]
        reader.cut_back(self.start)
        kept = {_key(record) for record in reader.feed(same)}  # yielded, and still there
        file.seek(self.start + len(same))
        return _ReadWindow(self.start, same), set().union(*self.keys) - kept


def _key(record: TapRecord) -> tuple | None:
    """What tells a record from others of its stream: where it came from and its sequence
    (None for streams of an older version, which have no sequence)."""
    return (record.process, record.device_id, record.sequence) if record.sequence >= 0 else None


def follow_records(path: str | os.PathLike, poll_seconds: float = 0.2,
                   should_stop: Callable[[], bool] | None = None) -> Iterator[TapRecord]:
    """The records of a growing stream file, as they are written; follows rotation.

    When FileSink rotates ``path`` to ``path.1`` (once or many times between two looks), the rest
    of the old file is read, then each newer file in turn. Where a file is cut back in place
    (a writer undoing a write the disk took only in part) and maybe written again, reading goes
    on from where it differs from what was read. Damage is skipped and logged as in
    read_records. Ends when ``should_stop()`` is true at the end of the data.
    """
    path = os.fspath(path)
    if storage.is_url(path):
        yield from storage.follow_parts(path, read_records, poll_seconds, should_stop)
        return
    file = open(path, "rb")  # noqa: SIM115 (replaced as the stream rotates)
    reader = StreamReader(on_skip=_warn_skipped(path))
    window, cut_off = _ReadWindow(), set()  # cut_off: keys of records yielded, then cut off
    try:
        while True:
            chunk = file.read(1 << 20)
            if chunk:
                if window.changed_on(file):  # cut back, and written again since
                    window, cut_off = window.read_on_from_the_cut(file, reader)
                    continue
                records = reader.feed(chunk)
                window.add(chunk, reader.next_frame_at, records)
                for record in records:
                    key = _key(record)
                    if key is None or key not in cut_off:
                        yield record
                    else:
                        cut_off.discard(key)  # written again: yielded once already
                continue
            try:
                current = os.stat(path)
            except FileNotFoundError:  # between a rotation's rename and the new file
                current = None
            opened = os.fstat(file.fileno())
            if opened.st_size < file.tell():  # cut back, not written again yet
                window, cut_off = window.read_on_from_the_cut(file, reader)
                continue
            if current is not None and current.st_ino != opened.st_ino:
                chunk = file.read()  # a last write may have landed since
                records = reader.feed(chunk) + reader.finish() if chunk else reader.finish()
                yield from records
                # Open the next file while the old one is still open: its inode cannot be
                # reused by a newer file meanwhile (rotation deletes the oldest), which would make
                # _open_next take the newer file for the old one.
                following = _open_next(path, opened.st_ino, opened.st_mtime_ns)
                file.close()
                file = following
                reader = StreamReader(on_skip=_warn_skipped(file.name))
                window, cut_off = _ReadWindow(), set()
                continue
            if should_stop is not None and should_stop():
                return
            time.sleep(poll_seconds)
    finally:
        file.close()


def _names_a_stream(path: str) -> bool:
    """Whether a stream (or its rotated files, or its parts) is at exactly ``path``."""
    if storage.is_url(path):
        return bool(storage.stream_parts(path, fresh=True))
    return os.path.exists(path) or os.path.exists(path + ".1")


def expand_streams(patterns: Iterable[str | os.PathLike]) -> list[str]:
    """The streams that paths, URLs and globs of them name, each once, in the order given (a
    glob's matches sorted; a name with glob characters that is itself a stream is that stream).
    A glob that matches nothing is a FileNotFoundError naming it."""
    streams: list[str] = []
    for pattern in map(os.fspath, patterns):
        if not storage.has_glob(pattern) or _names_a_stream(pattern):
            found = [pattern]  # a stream named "sweep[lr=0.1].hcbs" is that stream
        elif storage.is_url(pattern):
            found = storage.matching_streams(pattern)
        else:
            found = sorted({re.sub(r"\.\d+$", "", name) for name in glob.glob(pattern)
                            + glob.glob(pattern + ".[0-9]*")})
        if not found:
            raise FileNotFoundError(2, "no stream matches", pattern)
        streams.extend(name for name in found if name not in streams)
    return streams


def merged_records(paths: Iterable[str | os.PathLike],
                   skipped: list[SkippedRange] | None = None) -> list[TapRecord]:
    """The records of many streams as one run: ordered by process, device and sequence, and
    where those are equal (streams of an older version have no sequence) as the streams are
    given and each stream's records were written. A stream that holds several runs (a program
    run again appends to its file, and its sequences start again) keeps each run whole, in the
    order they were written."""
    keyed = []
    for n, stream in enumerate(expand_streams(paths)):
        # Per process and device: the first sequence of its run so far, and how many runs
        # began before it. Only a sequence at or below that first one begins a new run: two
        # senders of one device (a collected run) interleave batches of one run.
        first: dict[tuple[int, int], int] = {}
        runs: dict[tuple[int, int], int] = {}
        for i, record in enumerate(read_stream(stream, skipped)):
            source = (record.process, record.device_id)
            if 0 <= record.sequence <= first.get(source, -1):
                runs[source] = runs.get(source, 0) + 1
                first[source] = record.sequence
            elif source not in first:
                first[source] = record.sequence
            keyed.append(((*source, runs.get(source, 0), record.sequence), n, i, record))
    keyed.sort(key=lambda item: item[:3])
    return [record for *_, record in keyed]
