"""Soak: a training loop on 4 forced CPU devices with taps, calls, a FileSink and a SocketSink to
a collector, for a given time; fails on a lost or duplicated record or on memory growth.

    python bench/soak.py --minutes 30 --barrier-every 50

Each step taps a small record (the loss, with its step) on every device through pmap, a 1 MiB
array from one device, and calls the host once (a result checked on the device side). Every
minute it prints records sent and received per stream, duplicates, the process's RSS and the
queues' high-water marks. At the end it reads back the file and the collector's run file and
checks that every step's records arrived exactly once, in order per device. Memory may grow by
at most --max-growth-mib after the first minute (the warm-up: compilation, pools, buffers).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hostcallback as hcb  # noqa: E402
from hostcallback.consumer import FileSink, SocketSink, read_records, tap_to  # noqa: E402
from hostcallback.consumer.collector import CollectorThread  # noqa: E402

DEVICES = 4
BIG = 1 << 18  # float32 elements: 1 MiB


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Counter:
    """Per (stream, device): each step exactly once, in order (so the next is the last + 1)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count_and_last: dict[tuple, list[int]] = {}
        self.problems: list[str] = []

    def add(self, stream: str, device: int, step: int) -> None:
        with self.lock:
            entry = self.count_and_last.setdefault((stream, device), [0, -1])
            if step != entry[1] + 1:
                self.problems.append(f"{stream} on device {device}: step {step} after {entry[1]}")
            entry[0] += 1
            entry[1] = step

    def count(self, stream: str) -> int:
        with self.lock:
            return sum(v[0] for (s, _), v in self.count_and_last.items() if s == stream)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--barrier-every", type=int, default=50)
    parser.add_argument("--max-growth-mib", type=float, default=64.0,
                        help="RSS growth allowed after the first minute (docs/reliability.md)")
    args = parser.parse_args()

    out = tempfile.mkdtemp(prefix="hostcallback-soak-")
    collector = CollectorThread(out).start()
    file_sink = FileSink(os.path.join(out, "file.hcbs"))
    socket_sink = SocketSink("127.0.0.1", collector.port, run="soak")
    counter = Counter()
    calls = [0]

    def small(loss_and_step, transforms, device):
        counter.add("small", device.id, int(loss_and_step["step"]))

    def big(value, transforms, device):
        assert value.shape == (BIG,) and float(value[0]) == float(value[-1])
        counter.add("big", device.id, int(value[0]))

    def host_scale(x):
        calls[0] += 1
        return np.asarray(x) * 2

    @jax.pmap
    def step(w, s):
        loss = jnp.sum(w ** 2)
        hcb.id_tap(small, {"loss": loss, "step": s}, tap_with_device=True)
        tap_to([file_sink, socket_sink], {"loss": loss, "step": s}, name="loss")
        hcb.id_tap(big, jnp.full((BIG,), s, jnp.float32) + 0 * loss, tap_with_device=True)
        doubled = hcb.call(host_scale, s, result_shape=s)
        return w * 0.999 + 1e-3 * (doubled - 2 * s), s + 1

    w = jnp.ones((DEVICES, 64), jnp.float32)
    s = jnp.zeros((DEVICES,), jnp.int32)
    start = time.monotonic()
    end = start + args.minutes * 60
    next_report, minute, baseline, steps = start + 60, 0, None, 0
    peak_queued = 0
    print(f"soak: {args.minutes} min on {DEVICES} devices, barrier every {args.barrier_every} "
          f"steps, files in {out}", flush=True)
    while time.monotonic() < end:
        w, s = step(w, s)
        steps += 1
        if steps % args.barrier_every == 0:
            hcb.barrier_wait(timeout=300)
            stats = hcb.queue_stats()
            peak_queued = max(peak_queued, max(v["peak_bytes_queued"] for v in stats.values()))
        if time.monotonic() >= next_report:
            minute += 1
            next_report += 60
            rss = rss_mib()
            baseline = rss if baseline is None else baseline
            max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"minute {minute}: steps {steps}, small {counter.count('small')}, big "
                  f"{counter.count('big')}, calls {calls[0]}, out of order {len(counter.problems)}"
                  f", RSS {rss:.0f} MiB (after minute 1: {rss - baseline:+.0f}, max "
                  f"{max_rss:.0f}), peak queued {peak_queued / 2**20:.1f} MiB, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    hcb.barrier_wait(timeout=300)
    file_sink.close()
    unsent = socket_sink.close(timeout=60)
    collector.stop()
    growth = rss_mib() - (baseline if baseline is not None else rss_mib())

    failures = list(counter.problems[:10])
    expected = steps * DEVICES
    for stream in ("small", "big"):
        got = counter.count(stream)
        if got != expected:
            failures.append(f"{stream}: {got} records for {expected} (lost or duplicated)")
    if calls[0] != expected:
        failures.append(f"calls: {calls[0]} for {expected}")
    for label, path in (("file", os.path.join(out, "file.hcbs")),
                        ("collector", collector.collector.path_for("soak"))):
        read_back = Counter()
        for record in read_records(path):
            read_back.add(label, record.device_id, int(record.value["step"]))
        failures += read_back.problems[:10]
        if read_back.count(label) != expected:
            failures.append(f"{label} stream: {read_back.count(label)} records for {expected}")
    if unsent:
        failures.append(f"socket sink: {unsent} records never acknowledged")
    if growth > args.max_growth_mib:
        failures.append(f"RSS grew {growth:.0f} MiB after minute 1 (bound {args.max_growth_mib})")
    print(f"soak: {steps} steps, {expected} records per stream, {collector.collector.counts()}; "
          f"RSS growth after minute 1: {growth:+.0f} MiB; "
          f"peak queued {peak_queued / 2**20:.1f} MiB")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("soak passed: nothing lost, nothing duplicated, memory within bound")
    shutil.rmtree(out, ignore_errors=True)  # kept when it failed, to look at
    return 0


if __name__ == "__main__":
    sys.exit(main())
