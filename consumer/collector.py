"""The collector: one asyncio TCP server that gathers record streams from many processes.

Each connection sends a stream (header, then records), as SocketSink does. The header's ``run``
picks the output file ``OUT/<run>.hcbs``, shared by every process of that run; each record is
tagged with its source (``host:pid/p<process>``) and appended as one complete msgpack record.
After writing, the collector acknowledges with the number of records received on the connection
so far (8 bytes, little-endian), so the sender can forget them. A client that disconnects
mid-record loses only that torn record, which its sender still holds and sends again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from typing import BinaryIO

from consumer.stream import ACK, StreamFormatError, StreamReader, StreamWriter, pack

logger = logging.getLogger("hostcallback.collector")

_SAFE_RUN = re.compile(r"[^A-Za-z0-9_.-]+")


class Collector:
    """Writes incoming records to per-run files; ``serve`` runs it until cancelled."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = os.fspath(out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        self._files: dict[str, BinaryIO] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self.records_written = 0
        self.connections = 0

    def path_for(self, run: str) -> str:
        return os.path.join(self.out_dir, (_SAFE_RUN.sub("_", run) or "run") + ".hcbs")

    def _file_for(self, run: str) -> BinaryIO:
        file = self._files.get(run)
        if file is None:
            path = self.path_for(run)
            fresh = not os.path.exists(path) or os.path.getsize(path) == 0
            file = open(path, "ab")
            StreamWriter(file, write_header=fresh, run=run, collected=True)
            self._files[run] = file
        return file

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        stream = StreamReader()
        peer = writer.get_extra_info("peername")
        received = 0
        try:
            while True:
                chunk = await reader.read(1 << 16)
                if not chunk:
                    break
                records = stream.feed(chunk)
                if not records:
                    continue
                header = stream.header or {}
                run = str(header.get("run", "run"))
                source = f"{header.get('host', '?')}:{header.get('pid', '?')}/p{header.get('process', 0)}"
                file = self._file_for(run)
                for record in records:
                    record.source = source
                    file.write(pack(record.to_map()))
                file.flush()
                self.records_written += len(records)
                received += len(records)
                writer.write(ACK.pack(received))
                await writer.drain()
        except StreamFormatError as error:
            logger.warning("collector: dropping connection from %s: %s", peer, error)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    async def serve(self, host: str, port: int, ready: asyncio.Event | None = None) -> None:
        server = await asyncio.start_server(self.handle, host, port)
        self.port = server.sockets[0].getsockname()[1]
        logger.info("collector: listening on %s:%d, writing to %s", host, self.port, self.out_dir)
        if ready is not None:
            ready.set()
        try:
            async with server:
                await server.serve_forever()
        finally:
            for writer in list(self._writers):  # drop the clients, so that their senders notice
                writer.transport.abort()
            await asyncio.sleep(0)
            self.close()


class CollectorThread:
    """A Collector serving from a background thread (tests, notebooks, a launcher process)."""

    def __init__(self, out_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0) -> None:
        self.collector = Collector(out_dir)
        self.host, self.port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> CollectorThread:
        started = threading.Event()

        async def run() -> None:
            ready = asyncio.Event()
            self._task = asyncio.ensure_future(self.collector.serve(self.host, self.port, ready))
            await ready.wait()
            self.port = self.collector.port
            started.set()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(run())
            self._loop.close()

        self._thread = threading.Thread(target=main, daemon=True, name="hostcallback-collector")
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"collector did not start listening within {timeout} s")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(10)
