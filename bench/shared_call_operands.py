"""A call in a jit over 4 forced CPU devices with a large operand, sharded or replicated: the
native transport, whose devices meet in its handler (each shard sent once, nothing gathered),
against the callback transport, whose devices gather the operand and sum the answer in XLA
collectives, in one run.

  ms/call   best of --repeats rounds of --calls calls, each waited for

Usage: python bench/shared_call_operands.py [--megabytes 32] [--calls 20] [--repeats 3]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb

SCALAR = jax.ShapeDtypeStruct((), jnp.float32)


def total(v) -> np.float32:
    return np.float32(v[:16].sum())  # the host looks at the value; the answer is small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mesh = jax.make_mesh((4,), ("d",))
    value = np.ones(args.megabytes << 18, np.float32)
    runs = {}
    for spec in (P("d"), P()):
        x = jax.device_put(value, NamedSharding(mesh, spec))
        for transport in ("native", "callback"):
            with hcb.config.override(transport=transport):
                step = jax.jit(lambda x: hcb.call(total, x, result_shape=SCALAR))
                step(x).block_until_ready()  # compiled
            runs[(str(spec), transport)] = (step, x, [])
    for _ in range(args.repeats):  # rounds alternate, so a loaded machine slows all alike
        for step, x, times in runs.values():
            start = time.perf_counter()
            for _ in range(args.calls):
                step(x).block_until_ready()
            times.append((time.perf_counter() - start) / args.calls)
    print(f"a call of a {args.megabytes} MB float32 on 4 devices, best of {args.repeats}")
    print(f"{'operand':<10}{'transport':<12}{'ms/call':>10}")
    for (spec, transport), (_, _, times) in runs.items():
        print(f"{spec:<10}{transport:<12}{min(times) * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
