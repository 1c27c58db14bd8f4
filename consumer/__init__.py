"""Ready-made tap consumers: record streams to files and sockets, logging, running statistics,
and a collector for many processes. See the documents "Record stream format" and "Consumers"."""

from consumer.sinks import (
                            FileSink,
                            LoggingSink,
                            Sink,
                            SinkTap,
                            SocketSink,
                            StatsSink,
                            summarize,
                            tap_to,
)
from consumer.stream import StreamFormatError, StreamReader, StreamWriter, TapRecord, read_records

__all__ = ["FileSink", "LoggingSink", "Sink", "SinkTap", "SocketSink", "StatsSink",
           "StreamFormatError", "StreamReader", "StreamWriter", "TapRecord", "read_records",
           "summarize", "tap_to"]
