"""Records per second through the ready sinks: FileSink, StatsSink, SocketSink to a local collector.

A jitted fori_loop taps ``{"step": i, "loss": x}`` to one sink with ``tap_to`` every step; the time
runs from the start of the computation until ``barrier_wait`` returns (the file flushed, the
collector's acknowledgements in). The collector runs in this process (CollectorThread) on
loopback, so it shares the machine's cores with the sender. Goal: >= 200k records/s to a file.

Usage: python bench/sink_throughput.py [--steps N] [--repeats R] [--sinks file,stats,socket]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax

import hostcallback as hcb
from hostcallback.consumer import FileSink, SocketSink, StatsSink, tap_to
from hostcallback.consumer.collector import CollectorThread


def run_once(sink, steps: int) -> float:
    loop = jax.jit(lambda x: lax.fori_loop(
        0, steps, lambda i, c: tap_to([sink], {"step": i, "loss": c + 1.0}, name="train")["loss"],
        x))
    loop(jnp.float32(0)).block_until_ready()  # compile and warm up
    hcb.barrier_wait()
    start = time.perf_counter()
    loop(jnp.float32(0)).block_until_ready()
    hcb.barrier_wait()
    return time.perf_counter() - start


def measure(name: str, steps: int, repeats: int, directory: str) -> list[float]:
    times = []
    collector = None
    if name == "file":
        sink = FileSink(os.path.join(directory, "taps.hcb"))
    elif name == "stats":
        sink = StatsSink()
    else:
        collector = CollectorThread(os.path.join(directory, "collected")).start()
        sink = SocketSink("127.0.0.1", collector.port, run="bench")
    try:
        for _ in range(repeats):
            times.append(run_once(sink, steps))
    finally:
        sink.close()
        if collector is not None:
            collector.stop()
    return times


def main(argv=None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sinks", default="file,stats,socket")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {os.cpu_count()} CPU core(s); {args.steps:,} records per run, "
          f"{args.repeats} runs each (best, and the spread over runs)")
    print(f"{'sink':<10}{'records/s best':>16}{'worst':>12}{'us/record':>11}")
    out = {}
    with tempfile.TemporaryDirectory() as directory:
        for name in args.sinks.split(","):
            times = measure(name, args.steps, args.repeats, directory)
            out[name] = times
            print(f"{name:<10}{args.steps / min(times):>16,.0f}{args.steps / max(times):>12,.0f}"
                  f"{min(times) / args.steps * 1e6:>11.2f}")
    return out


if __name__ == "__main__":
    main()
