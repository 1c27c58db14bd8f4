"""FileSink: records appended to a stream file, rotated past a size limit; or written as parts
to any fsspec URL (``storage``).

It writes whole frames only, so a crash mid-write leaves every earlier record readable, and it
never rewrites what it wrote: rotation renames files (``path`` to ``path.1``, ...), as
``logging.handlers.RotatingFileHandler`` does; at a URL each part is written once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

from hostcallback.addons import add_flush_hook

from .sink_base import FrameSink, process_index
from .storage import PartWriter, filesystem, is_url
from .stream import StreamWriter

PLACEHOLDERS = ("{process}", "{host}")

logger = logging.getLogger("hostcallback.sinks")


def expand_placeholders(path: str) -> str:
    """``path`` with ``{process}`` (``jax.process_index()``) and ``{host}`` filled in."""
    if "{process}" in path:
        path = path.replace("{process}", str(process_index()))
    return path.replace("{host}", socket.gethostname())


class FileSink(FrameSink):
    """Appends records to a stream file; rotates it past ``max_bytes`` (0: never), keeping
    ``backup_count`` older files (``path.1`` the newest) and deleting the oldest past them.

    ``path`` may be an fsspec URL (``gs://bucket/run/{process}.hcbs``, ``s3://...``,
    ``memory://...``; ``pip install 'hostcallback[storage]'``): the stream is then written as
    parts, ``URL.part-000000`` and on, each closed once it holds ``part_bytes`` or its first
    record is ``part_seconds`` old, and at every ``barrier_wait`` and exit; a part the store
    refuses is kept (at most ``buffer_bytes`` of them, the oldest dropped past that and counted)
    and tried again, and each failed try is this sink's error at the next ``barrier_wait``.
    ``{process}`` and ``{host}`` in ``path`` are filled in at the first record.

    Every write is whole frames (one, or a receiver's batch of them), so a crash mid-write
    leaves every earlier record readable, and each goes to the operating system at once (a
    process that is killed or aborts loses none of the records this sink was given; an
    ``fsync`` is left to the system).
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = 0, backup_count: int = 5, *,
                 part_bytes: int = 8 << 20, part_seconds: float = 60.0,
                 buffer_bytes: int = 256 << 20) -> None:
        self.path = os.fspath(path)
        if max_bytes < 0 or (max_bytes and backup_count < 1):
            raise ValueError(
                f"FileSink({self.path!r}) needs max_bytes >= 0 and, to rotate, backup_count >= 1 "
                f"(got max_bytes={max_bytes!r}, backup_count={backup_count!r}): each rotation "
                "keeps backup_count older files; max_bytes=0 never rotates")
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self._said_oldest_deleted = self._said_rotation_failed = False
        self._part_settings = (part_bytes, part_seconds, buffer_bytes)
        self._lock = threading.Lock()
        self._file = None
        self._parts: PartWriter | None = None
        self._closed = False
        self._at_url = is_url(self.path)
        if self._at_url:
            filesystem(self.path)  # at once: fsspec, or the protocol's package, is missing
        elif not any(p in self.path for p in PLACEHOLDERS):
            self._open()  # at once: a path that cannot be written fails here
        add_flush_hook(self)

    def __repr__(self) -> str:
        return f"FileSink({self.path!r})"

    @property
    def dropped(self) -> int:
        """Records dropped because the store at the URL refused them for too long (each
        refusal's error says how many so far); 0 for a local file."""
        return self._parts.dropped if self._parts is not None else 0

    def _open(self) -> None:
        self.path = expand_placeholders(self.path)
        if is_url(self.path):
            self._parts = PartWriter(self.path, *self._part_settings)
            return
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # Unbuffered: a write that fails is undone whole (_append), none is left to go later.
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - open until close()
        # A header on every open: appending to an older file (even version 1) stays readable.
        self._writer = StreamWriter(self._file)

    def _opened(self) -> None:
        if self._closed:
            raise ValueError(f"FileSink({self.path!r}) is closed")
        if self._file is None and self._parts is None:
            self._open()

    def _rotate(self) -> None:
        """``path`` becomes ``path.1`` (and each ``path.N`` ``path.N+1``), and a new ``path`` is
        opened; the oldest past ``backup_count`` is deleted, as RotatingFileHandler does, and
        said once. A rotation that fails (``path`` moved or deleted by someone else, a folder
        made read-only) is said, and the records go on to ``path`` opened again."""
        self._file.close()
        self._file = None  # opened again below, or by the next write if that fails
        try:
            oldest = f"{self.path}.{self.backup_count}"
            if os.path.exists(oldest) and not self._said_oldest_deleted:
                self._said_oldest_deleted = True
                logger.warning("%r deletes %s, its oldest file, as it rotates (and each oldest "
                               "from now on): it keeps backup_count=%d older files",
                               self, oldest, self.backup_count)
            for index in range(self.backup_count - 1, 0, -1):
                older = f"{self.path}.{index}"
                if os.path.exists(older):
                    os.replace(older, f"{self.path}.{index + 1}")
            os.replace(self.path, f"{self.path}.1")
            self._said_rotation_failed = False
        except OSError as error:
            if not self._said_rotation_failed:  # said once until a rotation succeeds
                self._said_rotation_failed = True
                logger.warning("%r could not rotate (%s: %s); it appends to %s again",
                               self, type(error).__name__, error, self.path)
        finally:
            self._open()

    def emit_frame(self, data: bytes, name: str) -> None:
        with self._lock:
            self._write_locked([data])

    def emit_frames(self, frames: list[bytes], name: str) -> None:
        with self._lock:
            self._write_locked(frames)

    def _write_locked(self, frames: list[bytes]) -> None:
        self._opened()
        if self._parts is not None:
            self._parts.write(frames)
            return
        # Each batch goes to the operating system in one write (between rotations, which are
        # decided frame by frame): a process killed or aborted from now on loses none of them.
        batch: list[bytes] = []
        size = self._file.tell()
        for data in frames:
            if self.max_bytes and size + len(data) > self.max_bytes and size > 0:
                self._append(batch)
                batch = []
                self._rotate()
                size = self._file.tell()
            batch.append(data)
            size += len(data)
        self._append(batch)

    def _append(self, frames: list[bytes]) -> None:
        """Writes whole frames, or none of them: a write the disk takes only in part (full, a
        quota) is cut back off and raised, so the file never holds a torn frame, and no record
        said to be lost is written later."""
        if not frames:
            return
        before = self._file.tell()
        try:
            with memoryview(b"".join(frames)) as data:
                written = 0
                while written < len(data):
                    written += self._file.write(data[written:])
        except OSError as error:
            with contextlib.suppress(OSError):
                self._file.truncate(before)
                self._file.seek(before)  # else tell() stays past the end and misleads the next
            raise OSError(error.errno, f"{self!r} could not write {len(frames)} record(s) "
                          f"({error.strerror or error}); they are lost") from error

    def flush(self) -> None:
        with self._lock:
            if self._parts is not None:
                self._parts.flush()
            elif self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Writes what is left and closes; at a URL whose store refuses what is left, closes
        anyway and raises an OSError that says how many records are lost."""
        with self._lock:
            parts, file = self._parts, self._file
            self._parts, self._file, self._closed = None, None, True
            if file is not None:
                file.close()
            if parts is None:
                return
            try:
                parts.flush()
            except OSError as error:
                raise OSError(f"{self!r} closed with {parts.pending} record(s) its store did "
                              f"not take ({error.__cause__ or error})") from error
