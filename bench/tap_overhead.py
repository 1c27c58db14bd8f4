"""Per-tap cost of hostcallback against jax.debug.callback and io_callback, in one run.

Two workloads, each a jitted fori_loop that taps its carry every step:
  small: 100,000 steps tapping a 4-byte float32
  large:   1,000 steps tapping a 4 MiB float32 array
Each runs with no tap, hostcallback's native transport, its callback transport,
jax.debug.callback and jax.experimental.io_callback, all delivering to a trivial consumer.

  overhead us/tap  (time until the computation finished - the same loop without taps) / taps
  taps/s, MB/s     taps and bytes handled by the consumer per second, until the last was handled
  vs debug         jax.debug.callback's overhead divided by this one's (higher is better)

Usage: python bench/tap_overhead.py [--small-steps N] [--large-steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

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


def measure(kind: str, steps: int, shape: tuple[int, ...], repeats: int) -> dict:
    counter = Counter()
    with hcb.config.override(transport=kind if kind in ("native", "callback") else None):
        tap = tapper(kind, counter)
        loop = jax.jit(lambda x: lax.fori_loop(0, steps, lambda i, c: tap(c + 1), x))
        x = jnp.zeros(shape, jnp.float32)
        loop(x).block_until_ready()  # compile and warm up
        wait_for_delivery(kind)
        best_compute, best_delivered = float("inf"), float("inf")
        for _ in range(repeats):
            counter.taps = counter.bytes = 0
            start = time.perf_counter()
            loop(x).block_until_ready()
            computed = time.perf_counter() - start
            wait_for_delivery(kind)
            delivered = time.perf_counter() - start
            best_compute = min(best_compute, computed)
            best_delivered = min(best_delivered, delivered)
    expected = 0 if kind == "none" else steps
    if counter.taps != expected:
        raise AssertionError(f"{kind}: {counter.taps} taps delivered, expected {expected}")
    return {"compute_s": best_compute, "delivered_s": best_delivered, "taps": counter.taps,
            "bytes": counter.bytes}


KINDS = ("none", "native", "callback", "debug.callback", "io_callback")


def run_workload(name: str, steps: int, shape: tuple[int, ...], repeats: int) -> dict:
    results = {kind: measure(kind, steps, shape, repeats) for kind in KINDS}
    base = results["none"]["compute_s"]
    overheads = {k: max(r["compute_s"] - base, 1e-12) / steps for k, r in results.items()}
    tap_bytes = int(np.prod(shape)) * 4
    print(f"\n{name}: {steps:,} steps tapping {tap_bytes:,} bytes each "
          f"(loop without taps: {base * 1e3:.1f} ms)")
    print(f"{'transport':<16}{'overhead us/tap':>17}{'taps/s':>12}{'MB/s':>10}{'vs debug':>10}")
    for kind in KINDS[1:]:
        r = results[kind]
        ratio = overheads["debug.callback"] / overheads[kind]
        print(f"{kind:<16}{overheads[kind] * 1e6:>17.3f}{r['taps'] / r['delivered_s']:>12,.0f}"
              f"{r['bytes'] / r['delivered_s'] / 1e6:>10,.1f}{ratio:>9.1f}x")
    return {"overhead_us": {k: v * 1e6 for k, v in overheads.items()}, "results": results}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-steps", type=int, default=100_000)
    parser.add_argument("--large-steps", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"{jax.local_device_count()} local device(s)")
    small = run_workload("small", args.small_steps, (), args.repeats)
    large = run_workload("large", args.large_steps, (1 << 20,), args.repeats)
    return {"small": small, "large": large}


if __name__ == "__main__":
    main()
