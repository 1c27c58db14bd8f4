"""Record streams at fsspec URLs (``gs://``, ``s3://``, ``memory://``, ...): written in parts,
listed, read and followed.

An object store cannot append, so a stream at a URL is a sequence of parts, ``URL.part-000000``,
``URL.part-000001``, ...: each a whole record stream (its own header), written once and never
changed. ``PartWriter`` closes a part every ``part_bytes`` or ``part_seconds`` and at each flush
(every ``barrier_wait`` and exit) that finds records waiting, so nothing of a long run waits in
memory until its end; a part that cannot be written is kept, within a bound, and tried again.
fsspec is an optional dependency (the ``storage`` extra); local paths never need it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .stream import frame_item, stream_header

logger = logging.getLogger("hostcallback.stream")

PART = ".part-"
_PART_NUMBER = re.compile(re.escape(PART) + r"(\d+)$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB = re.compile(r"[*?\[]")


def is_url(path: str) -> bool:
    """Whether ``path`` names a stream through fsspec (``protocol://...``), not a local file."""
    return bool(_URL.match(path))


def has_glob(path: str) -> bool:
    return bool(_GLOB.search(path))


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it; an ImportError that says what to
    install when fsspec, or the protocol's own package (s3fs, gcsfs, ...), is missing."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"{url}: streams at URLs need fsspec; install it with "
                          "`pip install 'hostcallback[storage]'` (and the protocol's own "
                          "package, such as s3fs or gcsfs)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as error:  # fsspec knows the protocol and names the missing package
        raise ImportError(f"{url}: {error}") from None


def _is_local(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "file" in protocols or "local" in protocols


def part_path(path: str, number: int) -> str:
    return f"{path}{PART}{number:06d}"


def _part_number(path: str) -> int | None:
    match = _PART_NUMBER.search(path)
    return int(match.group(1)) if match else None


def stream_parts(url: str, fresh: bool = False) -> list[str]:
    """A stream's parts in order (URLs), after the stream's own object if there is one (a stream
    copied there whole). ``fresh`` lists again instead of trusting fsspec's listing cache."""
    fs, path = filesystem(url)
    if fresh:
        fs.invalidate_cache()
    numbered = sorted((number, found) for found in fs.glob(_escaped(path) + PART + "*")
                      if (number := _part_number(found)) is not None
                      and found == part_path(path, number))
    whole = [url] if fs.exists(path) else []
    return whole + [fs.unstrip_protocol(found) for _, found in numbered]


def matching_streams(pattern: str) -> list[str]:
    """The streams (URLs, sorted) a glob names: a stream matches if its own URL does, whether it
    was written whole or in parts."""
    fs, path = filesystem(pattern)
    fs.invalidate_cache()
    bases = set()
    hidden_named = os.path.basename(path).startswith(".")
    for found in fs.glob(path) + fs.glob(path + PART + "*"):
        if os.path.basename(found).startswith(".") and not hidden_named:
            continue  # a part being written aside (_link_new), as a shell's * leaves it out
        number = _part_number(found)
        base = found[:-len(part_path("", number))] if number is not None else found
        if fnmatch.fnmatchcase(base, path.lstrip("/")) or fnmatch.fnmatchcase(base, path):
            bases.add(base)
    return sorted(fs.unstrip_protocol(base) for base in bases)


def _escaped(path: str) -> str:
    """``path`` with glob characters matched literally."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def open_url(url: str):
    """A stream object at ``url``, opened for reading."""
    fs, path = filesystem(url)
    return fs.open(path, "rb")


def _link_new(path: str, data: bytes) -> None:
    """Writes ``path``, which must not exist, so that it appears with all of ``data``."""
    folder, name = os.path.split(path)
    aside = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.writing")  # listed by no reader
    try:
        with open(aside, "wb") as file:
            file.write(data)
        os.link(aside, path)  # FileExistsError if another writer made it first
    except FileExistsError:
        raise
    except OSError:
        if not os.path.exists(aside) or os.path.getsize(aside) != len(data):
            raise  # the data could not be written (a full disk, a read-only folder)
        with open(path, "xb") as file:  # a filesystem without hard links: created
            file.write(data)  # exclusively, written in place
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)


def follow_parts(url: str, read: Callable[[str], Iterator[Any]], poll_seconds: float,
                 should_stop: Callable[[], bool] | None) -> Iterator[Any]:
    """The records of a stream at a URL as its parts are written: each part once it exists
    (parts are written whole, so a part that is listed is complete). Ends when
    ``should_stop()`` is true once every part listed has been read."""
    seen: set[str] = set()
    while True:
        # Asked before listing: a part written just before should_stop() turned true is read.
        stopping = should_stop is not None and should_stop()
        new = [part for part in stream_parts(url, fresh=True) if part not in seen]
        for part in new:
            seen.add(part)
            yield from read(part)
        if not new:
            if stopping:
                return
            time.sleep(poll_seconds)


class PartWriter:
    """Writes a stream at a URL as parts (see the module's docstring); thread-safe.

    ``write`` takes framed records; a part is written once it holds ``part_bytes``, or its
    first record is ``part_seconds`` old, or ``flush`` is called. A part that cannot be written
    is kept and tried again (at most every ``retry_seconds``): each failed try raises an OSError
    that names the part's URL and the records kept, and past ``buffer_bytes`` kept the oldest
    are dropped, counted in ``dropped`` and in the next error's message.
    """

    def __init__(self, url: str, part_bytes: int, part_seconds: float, buffer_bytes: int,
                 retry_seconds: float = 5.0) -> None:
        for name, value in (("part_bytes", part_bytes), ("part_seconds", part_seconds),
                            ("buffer_bytes", buffer_bytes)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        self.url = url
        self.fs, self.path = filesystem(url)
        self.part_bytes, self.part_seconds = part_bytes, part_seconds
        self.buffer_bytes, self.retry_seconds = buffer_bytes, retry_seconds
        self.dropped = 0  # records dropped because the store refused them for too long
        self._lock = threading.Lock()
        self._frames: list[bytes] = []  # the open part's records
        self._bytes = 0
        self._opened_at = 0.0
        self._waiting: list[tuple[bytes, int]] = []  # closed parts not written: (data, records)
        self._next_try = 0.0
        self._timer: threading.Timer | None = None
        self._next_number: int | None = None  # asked of the store with the first part written

    def write(self, frames: list[bytes]) -> None:
        with self._lock:
            if not self._frames:
                self._opened_at = time.monotonic()
                self._start_timer()
            self._frames.extend(frames)
            self._bytes += sum(map(len, frames))
            if self._bytes >= self.part_bytes or \
                    time.monotonic() - self._opened_at >= self.part_seconds:
                self._close_part()
            self._write_waiting(force=False)

    @property
    def pending(self) -> int:
        """Records not written yet: in the open part and in parts kept from a failed try."""
        with self._lock:
            return len(self._frames) + sum(records for _, records in self._waiting)

    def flush(self) -> None:
        """Writes the open part (if it holds records) and every part kept from a failed try."""
        with self._lock:
            self._close_part()
            self._write_waiting(force=True)

    def _start_timer(self) -> None:
        self._timer = threading.Timer(self.part_seconds, self._close_when_due)
        self._timer.daemon = True  # exit flushes; the timer must not hold the process up
        self._timer.start()

    def _close_when_due(self) -> None:
        try:
            with self._lock:
                if self._frames and time.monotonic() - self._opened_at >= self.part_seconds:
                    self._close_part()
                    self._write_waiting(force=False)
        except OSError as error:  # no caller here: the next write or flush raises it again
            logger.warning("%s", error)

    def _close_part(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._frames:
            return
        data = frame_item(stream_header()) + b"".join(self._frames)
        self._waiting.append((data, len(self._frames)))
        self._frames, self._bytes = [], 0
        self._drop_past_bound()

    def _write_waiting(self, force: bool) -> None:
        if not self._waiting or (not force and time.monotonic() < self._next_try):
            return
        while self._waiting:
            data, _ = self._waiting[0]
            target = self.url
            try:
                if self._next_number is None:  # a restarted run adds parts after the last
                    if _is_local(self.fs):  # object stores have no folders to make
                        self.fs.makedirs(os.path.dirname(self.path), exist_ok=True)
                    numbers = [number for part in stream_parts(self.url, fresh=True)
                               if (number := _part_number(part)) is not None]
                    self._next_number = max(numbers, default=-1) + 1
                part = part_path(self.path, self._next_number)
                target = self.fs.unstrip_protocol(part)
                if not self._write_new(part, data):  # another writer on this URL took the
                    self._next_number += 1  # number: the next
                    continue
            except Exception as error:  # noqa: BLE001 - credentials, network, a missing bucket
                self._next_try = time.monotonic() + self.retry_seconds
                kept = sum(records for _, records in self._waiting)
                dropped = f"; {self.dropped} dropped so far" if self.dropped else ""
                raise OSError(f"writing {target} failed ({type(error).__name__}: {error}); "
                              f"{kept} record(s) kept to try again{dropped}") from error
            self._waiting.pop(0)
            self._next_number += 1

    def _write_new(self, part: str, data: bytes) -> bool:
        """Writes a part that does not exist yet, or returns False: two writers on one
        URL (processes without ``{process}``, a restarted one while the old one flushes) do not
        overwrite each other's parts. A local part is linked into place whole, so a follower
        never reads one half written; in a store, a write that races another's within the
        moment between its check and its upload is the window left (exclusive writes are not
        supported alike by the S3-compatible stores)."""
        if _is_local(self.fs):
            try:
                _link_new(part, data)
            except FileExistsError:
                return False
            return True
        self.fs.invalidate_cache(part)
        if self.fs.exists(part):
            return False
        self.fs.pipe_file(part, data)
        return True

    def _drop_past_bound(self) -> None:
        """Past ``buffer_bytes`` of parts not written, the oldest go (the newest stays)."""
        while len(self._waiting) > 1 and \
                sum(len(data) for data, _ in self._waiting) > self.buffer_bytes:
            _, records = self._waiting.pop(0)
            self.dropped += records
