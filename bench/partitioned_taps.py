"""Per-shard taps (partitioned=True) against whole-value taps and jax.debug.callback, in one run.

A jit over 4 forced CPU devices updates an 8 MiB float32 array sharded by rows and taps it every
step. Compared: no tap; hostcallback's whole-value tap (the default: the value is gathered onto
every device and device 0 sends it); hostcallback's partitioned tap (each device sends its shard);
both again on the callback transport (what GPUs and TPUs use today); jax.debug.callback, whole and
partitioned.

  ms/step       wall time per step, until every tap was handled
  host MB/step  bytes the consumer received per step (hostcallback: bytes enqueued, headers in)
  all-gathers   collective ops XLA compiled in to bring the shards together before the tap
  vs debug      jax.debug.callback's (same form) time per step divided by this one's

The partitioned form must move the shards and nothing else: host bytes equal the array's bytes
(plus one 48-byte header and shape per shard) and no all-gather.

Usage: python bench/partitioned_taps.py [--steps N] [--rows R]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import argparse
import threading
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb


class Counter:
    """Bytes received; jax.debug.callback calls it from several device threads at once."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def __call__(self, arg, *rest) -> None:
        with self._lock:
            self.bytes += arg.nbytes  # no np.asarray: with several devices it can hang (jax#25861)


def tap(kind: str, counter: Counter):
    return {
        "none": lambda x: x,
        "whole": lambda x: hcb.id_tap(counter, x),
        "partitioned": lambda x: hcb.id_tap(counter, x, partitioned=True),
        "debug whole": lambda x: (jax.debug.callback(counter, x), x)[1],
        "debug partitioned": lambda x: (jax.debug.callback(counter, x, partitioned=True), x)[1],
    }[kind.removeprefix("callback ")]


def transport_of(kind: str) -> str:
    return "callback" if kind.startswith("callback ") else "native"


def enqueued_bytes() -> int:
    return sum(s["bytes_enqueued"] for s in hcb.queue_stats().values())


def measure(kind: str, x, steps: int) -> dict:
    with hcb.config.override(transport=transport_of(kind)):
        return _measure(kind, x, steps)


def _measure(kind: str, x, steps: int) -> dict:
    counter = Counter()
    step = jax.jit(lambda x: tap(kind, counter)(x * 1.0001))
    compiled = step.lower(x).compile().as_text()
    x = jax.block_until_ready(step(x))  # warm up
    hcb.barrier_wait()
    jax.effects_barrier()
    counter.bytes, before = 0, enqueued_bytes()
    start = time.perf_counter()
    for _ in range(steps):
        x = step(x)
    jax.block_until_ready(x)
    hcb.barrier_wait()
    jax.effects_barrier()
    seconds = time.perf_counter() - start
    hcb_bytes = enqueued_bytes() - before
    return {"ms": seconds / steps * 1e3,
            "host_bytes": (counter.bytes if kind.startswith("debug") else hcb_bytes) / steps,
            "all_gathers": compiled.count("all-gather(") + compiled.count("all-gather-start(")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=2048)
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((4,), ("rows",))
    x = jax.device_put(jnp.ones((args.rows, 1024), jnp.float32), NamedSharding(mesh, P("rows")))
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices; "
          f"{x.nbytes / 2**20:.1f} MiB array sharded by rows; {args.steps} steps")
    kinds = ("none", "whole", "partitioned", "callback whole", "callback partitioned",
             "debug whole", "debug partitioned")
    results = {kind: measure(kind, x, args.steps) for kind in kinds}
    print(f"{'tap':<22}{'ms/step':>9}{'host MB/step':>14}{'all-gathers':>13}{'vs debug':>10}")
    for kind, r in results.items():
        debug = results.get(f"debug {kind.removeprefix('callback ')}")
        ratio = f"{debug['ms'] / r['ms']:>10.2f}" if debug and debug is not r else ""
        print(f"{kind:<22}{r['ms']:>9.2f}{r['host_bytes'] / 1e6:>14.3f}{r['all_gathers']:>13}"
              f"{ratio}")
    for kind in ("partitioned", "callback partitioned"):
        print(f"{kind} host bytes / array bytes: {results[kind]['host_bytes'] / x.nbytes:.6f}")
    return results


if __name__ == "__main__":
    main()
