"""What a stream of taps costs the host: one small jitted call with one tap, at a fixed interval.

A training loop taps once a step, every few milliseconds. Between records the receiver sleeps,
so on the host a record costs mostly the receiver waking up (about 40 us of CPU a wake-up on a
small VM), not Python. For each interval this runs --taps calls of a jitted function, with a tap
of each kind and without one, in interleaved rounds, and prints per record:

  host CPU us   the process's CPU time (every thread: the device's, the receiver's, wake-ups)
                beyond the same calls without a tap; median of the rounds
  receiver us   (hostcallback) the receiver threads' CPU time, which the load hardly moves
  batches       (hostcallback) batches the receiver took: 1.00 when every record woke it
  device wakes  (hostcallback) wake-up calls the device threads made (queue_stats())

jax.debug.callback and io_callback run their Python on the device's thread instead; their CPU
is in the same column.

Usage: python bench/stream_overhead.py [--taps N] [--intervals-ms 0.3 3] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax.experimental import io_callback
from receiver_cpu import receiver_cpu_seconds

import hostcallback as hcb
from hostcallback import config


def discard(*args):
    return None


def io_discard(x):
    io_callback(discard, None, x)


TAPS = {
    "no tap": lambda x: None,
    "hostcallback": lambda x: hcb.id_tap(discard, x),
    "callback transport": lambda x: hcb.id_tap(discard, x),
    "debug.callback": lambda x: jax.debug.callback(discard, x),
    "io_callback": io_discard,
}


def make_call(kind: str):
    tap = TAPS[kind]

    @jax.jit
    def call(x):
        y = x * 1.5 + 1.0
        tap(y)
        return y

    return call


def transport(kind: str):
    return config.override(transport="callback" if kind == "callback transport" else "native")


def receiver_counts() -> tuple[float, int, int]:
    """(receiver CPU seconds, batches, device wake-up calls) over every local queue so far."""
    stats = hcb.queue_stats().values()
    return (receiver_cpu_seconds(), sum(s["batches"] for s in stats),
            sum(s["receiver_wakeups"] for s in stats))


def run_stream(call, taps: int, interval_s: float) -> float:
    """Process CPU seconds for `taps` calls, one every interval_s, each waited for."""
    x = jnp.float32(1.0)
    cpu = time.process_time()
    due = time.perf_counter()
    for _ in range(taps):
        due += interval_s
        call(x).block_until_ready()
        left = due - time.perf_counter()
        if left > 0:
            time.sleep(left)
    hcb.barrier_wait()
    return time.process_time() - cpu


def measure(interval_s: float, taps: int, rounds: int) -> dict[str, dict[str, float]]:
    calls = {}
    for kind in TAPS:
        with transport(kind):  # compiled before timing, with each transport's barrier
            calls[kind] = make_call(kind)
            calls[kind](jnp.float32(0.0)).block_until_ready()
            hcb.barrier_wait()
    cpu = {kind: [] for kind in TAPS}
    receiver = {kind: [0.0, 0, 0] for kind in TAPS}  # CPU seconds, batches, device wake-ups
    for _ in range(rounds):
        for kind in TAPS:
            before = receiver_counts()
            with transport(kind):
                cpu[kind].append(run_stream(calls[kind], taps, interval_s))
            for i, (b, a) in enumerate(zip(before, receiver_counts())):
                receiver[kind][i] += a - b
    base = cpu["no tap"]
    out = {}
    for kind in TAPS:
        extra = [(c - b) / taps for c, b in zip(cpu[kind], base)]
        receiver_cpu, batches, wakes = (total / (taps * rounds) for total in receiver[kind])
        out[kind] = {"host_cpu_us": statistics.median(extra) * 1e6,
                     "receiver_us": receiver_cpu * 1e6, "batches": batches,
                     "device_wakes": wakes}
    return out


def main(argv=None) -> dict[float, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--taps", type=int, default=1000)
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[0.3, 3.0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.taps} taps a round, "
          f"median of {args.rounds} rounds")
    results = {}
    for interval_ms in args.intervals_ms:
        results[interval_ms] = measure(interval_ms / 1e3, args.taps, args.rounds)
        print(f"\none tap every {interval_ms} ms")
        print(f"{'variant':<22}{'host CPU us':>12}{'receiver us':>13}{'batches':>9}"
              f"{'device wakes':>14}")
        for kind, r in results[interval_ms].items():
            if kind == "no tap":
                continue
            ours = kind in ("hostcallback", "callback transport")
            columns = (f"{r['receiver_us']:>13.1f}{r['batches']:>9.2f}{r['device_wakes']:>14.2f}"
                       if ours else "")
            print(f"{kind:<22}{r['host_cpu_us']:>12.1f}{columns}")
    return results


if __name__ == "__main__":
    main()
