"""Ready-made tap consumers: record streams to files and sockets, logging, running statistics,
and a collector for many processes, progress bars and TensorBoard. See the documents "Record
stream format" and "Consumers"."""

from .file_sink import FileSink
from .logging_sink import LoggingSink, summarize
from .progress import (
                            ProgressSink,
                            loop_progress,
                            progress_fori_loop,
                            progress_scan,
                            scan_progress,
)
from .sink_base import FrameSink, Sink, SinkTap, tap_to
from .socket_sink import SocketSink
from .stats_sink import StatsSink
from .stream import StreamFormatError, StreamReader, StreamWriter, TapRecord
from .stream_files import read_records
from .tensorboard import TensorBoardSink

__all__ = [
                            "FileSink",
                            "FrameSink",
                            "LoggingSink",
                            "ProgressSink",
                            "Sink",
                            "SinkTap",
                            "SocketSink",
                            "StatsSink",
                            "StreamFormatError",
                            "StreamReader",
                            "StreamWriter",
                            "TapRecord",
                            "TensorBoardSink",
                            "loop_progress",
                            "progress_fori_loop",
                            "progress_scan",
                            "read_records",
                            "scan_progress",
                            "summarize",
                            "tap_to",
]
