"""FileSink: records appended to a stream file, rotated past a size limit.

It writes whole frames only, so a crash mid-write leaves every earlier record readable, and it
never rewrites what it wrote: rotation renames files (``path`` to ``path.1``, ...), as
``logging.handlers.RotatingFileHandler`` does.
"""

from __future__ import annotations

import os
import threading

from hostcallback.addons import add_flush_hook

from .sink_base import FrameSink
from .stream import StreamWriter


class FileSink(FrameSink):
    """Appends records to a stream file; rotates it past ``max_bytes`` (0: never).

    Every write is whole frames (one, or a receiver's batch of them), so a crash mid-write
    leaves every earlier record readable. The file is flushed after each ``barrier_wait`` and at
    exit.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = 0, backup_count: int = 5) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self._lock = threading.Lock()
        self._file = None
        self._open()
        add_flush_hook(self)

    def _open(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close()
        # A header on every open: appending to an older file (even version 1) stays readable.
        self._writer = StreamWriter(self._file)

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.backup_count - 1, 0, -1):
            older = f"{self.path}.{index}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{index + 1}")
        if self.backup_count > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.remove(self.path)
        self._open()

    def emit_frame(self, data: bytes, name: str) -> None:
        with self._lock:
            if self._file is None:
                raise ValueError(f"FileSink({self.path!r}) is closed")
            if self.max_bytes and self._file.tell() + len(data) > self.max_bytes \
                    and self._file.tell() > 0:
                self._rotate()
            self._file.write(data)

    def emit_frames(self, frames: list[bytes], name: str) -> None:
        if self.max_bytes:  # rotation is decided frame by frame
            super().emit_frames(frames, name)
            return
        with self._lock:
            if self._file is None:
                raise ValueError(f"FileSink({self.path!r}) is closed")
            self._file.write(b"".join(frames))

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
