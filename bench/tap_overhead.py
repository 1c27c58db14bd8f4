"""Per-tap cost of hostcallback against jax.debug.callback and io_callback, in one run.

Three workloads, each a fori_loop that taps its carry every step:
  small: 100,000 steps tapping a 4-byte float32 (jit, one device)
  large:   1,000 steps tapping a 4 MiB float32 array (jit, one device), plus a memcpy row:
           numpy copying 4 MiB into a reused buffer, the floor for a tap that copies once
  pmap:   25,000 steps tapping a 4-byte float32 on each of --devices CPU devices
Each runs with no tap, hostcallback's native transport, its callback transport,
jax.debug.callback and jax.experimental.io_callback, all delivering to a trivial consumer, in
interleaved rounds (best of --repeats), so that a loaded machine slows every variant alike.

  overhead us/tap  (time until the computation finished - the same loop without taps) / taps;
                   hostcallback's loops are compiled with delivery="async", so that this is the
                   device's own cost (by default a computation ends once its taps were handled,
                   at the pace of the records/s column)
  CPU              the same for the CPU time of every thread but hostcallback's receivers (the
                   device threads, and the callbacks' Python that runs on them): the tap's own
                   work. The overhead is larger where the device threads wait for a core that
                   other work (a receiver, other programs) holds, or for a lock, a full queue or
                   the GIL (Linux only)
  records/s, MB/s  taps and bytes handled by the consumer per second, until the last was handled
  us/step          (pmap) time per loop step until every device's tap was handled
  vs debug         jax.debug.callback's overhead divided by this one's (higher is better)

Usage: python bench/tap_overhead.py [--small-steps N] [--large-steps N] [--pmap-steps N]
                                    [--devices D] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _force_devices(argv: list[str]) -> None:
    """The CPU device count must be set before jax is imported."""
    count = "4"
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            count = argv[i + 1]
        elif arg.startswith("--devices="):
            count = arg.split("=", 1)[1]
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


_force_devices(sys.argv[1:])

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from receiver_cpu import device_cpu_seconds

import hostcallback as hcb


class Counter:
    """The trivial consumer: counts taps and bytes."""

    def __init__(self) -> None:
        self.taps = 0
        self.bytes = 0

    def __call__(self, arg, *rest) -> None:
        self.taps += 1
        self.bytes += np.asarray(arg).nbytes


def tapper(kind: str, counter: Counter):
    if kind == "none":
        return lambda c: c
    if kind in ("native", "callback"):
        return lambda c: hcb.id_tap(counter, c)
    if kind == "debug.callback":
        return lambda c: (jax.debug.callback(counter, c), c)[1]
    if kind == "io_callback":
        return lambda c: (io_callback(counter, None, c), c)[1]
    raise ValueError(kind)


def wait_for_delivery(kind: str) -> None:
    if kind in ("native", "callback"):
        hcb.barrier_wait()
    else:
        jax.effects_barrier()


class Variant:
    """One transport's compiled loop, run round by round beside the others."""

    def __init__(self, kind: str, steps: int, shape: tuple[int, ...], devices: int) -> None:
        self.kind, self.expected = kind, 0 if kind == "none" else steps * max(devices, 1)
        self.counter = Counter()
        self.best_compute = self.best_delivered = float("inf")
        self.best_cpu: float | None = None
        with self._transport():
            tap = tapper(kind, self.counter)
            body = (lambda x: lax.fori_loop(0, steps, lambda i, c: tap(c + 1), x))
            self.loop = jax.pmap(body) if devices else jax.jit(body)
            self.x = jnp.zeros((devices, *shape) if devices else shape, jnp.float32)
            self.loop(self.x).block_until_ready()  # compile and warm up
            wait_for_delivery(kind)

    def _transport(self):
        native = self.kind in ("native", "callback")
        # delivery="async": the computation ends when the device is done, so "overhead" is the
        # device's own cost of a tap (by default it would end once the taps were handled).
        return hcb.config.override(transport=self.kind if native else None, delivery="async")

    def run(self) -> None:
        with self._transport():
            self.counter.taps = self.counter.bytes = 0
            cpu_before = device_cpu_seconds()
            start = time.perf_counter()
            self.loop(self.x).block_until_ready()
            computed = time.perf_counter() - start
            cpu_after = device_cpu_seconds()
            wait_for_delivery(self.kind)
            delivered = time.perf_counter() - start
        if self.counter.taps != self.expected:
            raise AssertionError(f"{self.kind}: {self.counter.taps} taps delivered, expected "
                                 f"{self.expected}")
        if cpu_before is not None:
            cpu = cpu_after - cpu_before
            self.best_cpu = cpu if self.best_cpu is None else min(self.best_cpu, cpu)
        self.best_compute = min(self.best_compute, computed)
        self.best_delivered = min(self.best_delivered, delivered)

    def result(self) -> dict:
        return {"compute_s": self.best_compute, "delivered_s": self.best_delivered,
                "device_cpu_s": self.best_cpu,
                "taps": self.counter.taps, "bytes": self.counter.bytes}


def measure_all(kinds, steps: int, shape: tuple[int, ...], repeats: int,
                devices: int = 0) -> dict:
    """Best of `repeats` rounds, each running every variant once: load on a shared machine
    then hits the loop without taps and the tapped loops alike."""
    variants = [Variant(kind, steps, shape, devices) for kind in kinds]
    for _ in range(repeats):
        for variant in variants:
            variant.run()
    return {v.kind: v.result() for v in variants}


KINDS = ("none", "native", "callback", "debug.callback", "io_callback")


def memcpy_seconds(steps: int, nbytes: int, repeats: int) -> float:
    """Best time for `steps` copies of nbytes into one reused buffer (numpy, one thread)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


def _us(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.3f}"


def run_workload(name: str, steps: int, shape: tuple[int, ...], repeats: int,
                 devices: int = 0, kinds=KINDS) -> dict:
    results = measure_all(kinds, steps, shape, repeats, devices)
    base = results["none"]["compute_s"]
    taps = steps * max(devices, 1)
    overheads = {k: max(r["compute_s"] - base, 1e-12) / taps for k, r in results.items()}
    base_cpu = results["none"]["device_cpu_s"]
    cpu = {k: None if base_cpu is None else (r["device_cpu_s"] - base_cpu) / taps
           for k, r in results.items()}
    tap_bytes = int(np.prod(shape)) * 4
    where = f"pmap over {devices} devices" if devices else "jit, one device"
    print(f"\n{name}: {steps:,} steps tapping {tap_bytes:,} bytes each, {where} "
          f"(loop without taps: {base * 1e3:.1f} ms)")
    print(f"{'transport':<16}{'overhead us/tap':>17}{'CPU':>9}"
          f"{'records/s':>12}{'MB/s':>10}{'us/step':>10}{'vs debug':>10}")
    for kind in kinds[1:]:
        r = results[kind]
        ratio = overheads["debug.callback"] / overheads[kind]
        print(f"{kind:<16}{overheads[kind] * 1e6:>17.3f}{_us(cpu[kind]):>9}"
              f"{r['taps'] / r['delivered_s']:>12,.0f}"
              f"{r['bytes'] / r['delivered_s'] / 1e6:>10,.1f}"
              f"{r['delivered_s'] / steps * 1e6:>10.2f}{ratio:>9.1f}x")
    out = {"overhead_us": {k: v * 1e6 for k, v in overheads.items()},
           "cpu_us": {k: None if v is None else v * 1e6 for k, v in cpu.items()},
           "results": results}
    if tap_bytes >= 1 << 20:
        copy = memcpy_seconds(steps, tap_bytes, repeats) / steps
        native = overheads["native"]
        print(f"{'memcpy (numpy)':<16}{copy * 1e6:>17.3f}{'':>9}{1 / copy:>12,.0f}"
              f"{tap_bytes / copy / 1e6:>10,.1f}")
        print(f"native tap speed / memcpy speed: {copy / native:.0%} (memcpy time / tap overhead)")
        out["memcpy_us"] = copy * 1e6
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-steps", type=int, default=100_000)
    parser.add_argument("--large-steps", type=int, default=1_000)
    parser.add_argument("--pmap-steps", type=int, default=25_000)
    parser.add_argument("--devices", type=int, default=4,
                        help="CPU devices for the pmap workload (forced before jax starts)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"{jax.local_device_count()} local device(s), {os.cpu_count()} CPU core(s)")
    small = run_workload("small", args.small_steps, (), args.repeats)
    large = run_workload("large", args.large_steps, (1 << 20,), args.repeats)
    out = {"small": small, "large": large}
    if jax.local_device_count() > 1:
        # io_callback is left out: it refuses to run under pmap on several devices.
        out["pmap"] = run_workload("pmap", args.pmap_steps, (), args.repeats,
                                   devices=jax.local_device_count(),
                                   kinds=("none", "native", "callback", "debug.callback"))
    return out


if __name__ == "__main__":
    main()
