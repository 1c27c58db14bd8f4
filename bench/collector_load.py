"""The collector under load: N local client processes stream records as fast as they can.

Starts `hostcallback-consumer collect --port 0` as its own process, then N client processes on
loopback that each stream pre-encoded records (one realistic tap record, ~220 bytes framed, or
``--value-bytes`` more) for ``--seconds``, then wait for the collector to acknowledge everything.
With ``--sink`` the clients use SocketSink.emit instead (the sender's cost included).

  records/s, MB/s   records and bytes the collector wrote, per second of the run
  peak RSS          the collector process's peak resident memory (VmHWM), and before the load
  check             the run file holds exactly the acknowledged records, once each

Usage: python bench/collector_load.py [--clients 8] [--seconds 5] [--value-bytes 0] [--sink]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from hostcallback.consumer import SocketSink, TapRecord, protocol, stream
from hostcallback.consumer.run_files import scan_run_file


def sample_record(value_bytes: int) -> TapRecord:
    value = {"step": np.int32(7), "loss": np.float32(0.25)}
    if value_bytes:
        value["extra"] = np.zeros(value_bytes, np.uint8)
    return TapRecord(name="train", value=value, step=7, process=0, host="bench",
                     device="TFRT_CPU_0", device_id=0, sequence=7, time=time.time())


def raw_client(port: int, seconds: float, value_bytes: int, start, results) -> None:
    """Speaks the SocketSink protocol with pre-encoded frames: the collector is the bottleneck."""
    frame = stream.frame_item(sample_record(value_bytes).to_map())
    per_batch = max(1, (256 << 10) // len(frame))
    batch = frame * per_batch
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(stream.frame_item(stream.stream_header(
        run="load", process=0, sender=uuid.uuid4().hex, first=0)))
    acks, acknowledged, sent = bytearray(), 0, 0

    def read_acks(wait: float) -> None:
        nonlocal acknowledged
        while select.select([connection], [], [], wait)[0]:
            wait = 0
            chunk = connection.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the collector hung up")
            acks.extend(chunk)
        usable = len(acks) - len(acks) % 8
        if usable:
            acknowledged = protocol.ACK.unpack_from(acks, usable - 8)[0]
            del acks[:usable]

    start.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        connection.sendall(batch)
        sent += per_batch
        read_acks(0)
    deadline = time.monotonic() + 60
    while acknowledged < sent and time.monotonic() < deadline:
        read_acks(0.05)
    results.put((sent, acknowledged, time.monotonic()))
    connection.close()


def sink_client(port: int, seconds: float, value_bytes: int, start, results) -> None:
    """Streams through SocketSink.emit: what a real process pays to send."""
    record = sample_record(value_bytes)
    sink = SocketSink("127.0.0.1", port, run="load")
    start.wait()
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(100):
            sink.emit(record)
        sent += 100
    lost = sink.close(timeout=60)
    results.put((sent, sent - lost, time.monotonic()))


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """A process's peak (VmHWM) or current (VmRSS) resident memory."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--value-bytes", type=int, default=0)
    parser.add_argument("--sink", action="store_true", help="clients use SocketSink.emit")
    args = parser.parse_args()

    out_dir = tempfile.mkdtemp(prefix="collector-load-")
    collector = subprocess.Popen([sys.executable, "-m", "hostcallback.consumer", "collect",
                                  "--port", "0", "--out", out_dir],
                                 stdout=subprocess.PIPE, text=True)
    try:
        port = int(collector.stdout.readline().split(":")[1].split(",")[0])
        idle = rss_mib(collector.pid, "VmRSS")  # mostly imports (the CLI imports jax)
        context = multiprocessing.get_context("spawn")
        start, results = context.Event(), context.Queue()
        client = sink_client if args.sink else raw_client
        processes = [context.Process(target=client, args=(port, args.seconds, args.value_bytes,
                                                          start, results))
                     for _ in range(args.clients)]
        for process in processes:
            process.start()
        time.sleep(2.0)  # let every client connect before the clock starts
        began = time.monotonic()
        start.set()
        outcomes = [results.get(timeout=args.seconds + 120) for _ in processes]
        for process in processes:
            process.join(30)
        elapsed = max(finished for _, _, finished in outcomes) - began
        peak = rss_mib(collector.pid)
    finally:
        collector.send_signal(signal.SIGTERM)
        final = collector.communicate(timeout=60)[0].strip()
    sent = sum(s for s, _, _ in outcomes)
    acknowledged = sum(a for _, a, _ in outcomes)
    path = os.path.join(out_dir, "load.hcbs")
    senders, _, _ = scan_run_file(path)
    in_file = sum(senders.values())
    size = os.path.getsize(path)
    print(f"collector_load: {args.clients} {'SocketSink' if args.sink else 'raw'} clients, "
          f"{args.seconds:g} s, loopback, {os.cpu_count()} CPUs")
    print(f"  records written   {in_file:>12,}   ({sent:,} sent, {acknowledged:,} acknowledged)")
    print(f"  records/s         {in_file / elapsed:>12,.0f}")
    print(f"  MB/s              {size / elapsed / 1e6:>12.1f}   "
          f"({size / in_file:.0f} bytes/record)")
    print(f"  peak RSS          {peak:>12.1f} MiB (collector process; {idle:.1f} MiB before load)")
    exact = in_file == acknowledged
    print(f"  check             {'exactly the acknowledged records' if exact else 'MISMATCH'}")
    print(f"  {final}")
    os.remove(path)


if __name__ == "__main__":
    main()
