"""What a small native tap costs its device, apart from what delivering it costs the machine.

A jitted fori_loop taps a 4-byte float32 every step (tap_overhead.py's small workload), run three
ways in interleaved rounds (best of --repeats):

  no tap      the loop alone
  delivering  the receiver delivers the taps while the loop runs: what users see
  held        the consumer holds the receiver until the loop has finished, so the loop has the
              machine to itself; the taps are delivered afterwards (they wait in the queue)

Per tap, over the loop without taps: the wall time (what tap_overhead.py calls overhead) and the
CPU time of the threads that run the loop; and per run, how often those threads left their core
because they had to wait (voluntary: a lock, a full queue) or because the scheduler gave the core
to another thread (involuntary). Where "delivering" costs more wall time than "held" for the
same CPU time and few voluntary switches, the device waited for a core, not for us: on a machine
with fewer free cores than busy threads the receiver and the device share one. The script first
reports how busy other programs kept this machine's cores while it slept (Linux's /proc/stat).

Usage: python bench/device_side.py [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import jax
import jax.numpy as jnp
from jax import lax
from receiver_cpu import device_cpu_seconds, device_thread_ids

import hostcallback as hcb

RECORD_BYTES = 128  # a 4-byte tap's record, rounded up: what one held tap takes of the budget


def busy_cores_while_sleeping(seconds: float = 1.0) -> float | None:
    """How many cores' worth of CPU other programs used while this process slept."""

    def snapshot() -> list[int] | None:
        try:
            with open("/proc/stat") as stat:
                return [int(field) for field in stat.readline().split()[1:]]
        except OSError:
            return None

    before = snapshot()
    time.sleep(seconds)
    after = snapshot()
    if before is None or after is None:
        return None
    spent = [b - a for a, b in zip(before, after)]
    idle = spent[3] + spent[4]  # idle, iowait
    total = sum(spent[:8])  # user .. steal; guest time is already in user
    return (total - idle) / total * (os.cpu_count() or 1) if total else None


def context_switches() -> tuple[int, int] | None:
    """(voluntary, involuntary) context switches so far of the threads of device_thread_ids();
    None off Linux."""
    thread_ids = device_thread_ids()
    if thread_ids is None:
        return None
    voluntary = involuntary = 0
    for thread_id in thread_ids:
        try:
            with open(f"/proc/self/task/{thread_id}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        voluntary += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        involuntary += int(line.split()[1])
        except OSError:
            pass  # that thread has just ended
    return voluntary, involuntary


class HoldableCounter:
    """Counts taps; while ``released`` is clear it waits in the receiver before counting."""

    def __init__(self) -> None:
        self.taps = 0
        self.released = threading.Event()
        self.released.set()

    def __call__(self, arg, transforms) -> None:
        if not self.released.is_set():  # an attribute read; wait() takes a lock each call
            self.released.wait()
        self.taps += 1


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    budget = hcb.config.settings.max_queue_bytes
    if args.steps * RECORD_BYTES > budget:
        # Held taps wait in the queue; a full queue would make the loop wait for a receiver
        # that waits for the loop.
        parser.error(f"--steps {args.steps:,} held taps need about {args.steps * RECORD_BYTES:,} "
                     f"bytes of queue; HOSTCALLBACK_MAX_QUEUE_BYTES is {budget:,}")
    busy = busy_cores_while_sleeping()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPU core(s); "
          + ("other programs' load: unknown" if busy is None else
             f"other programs kept {busy:.1f} core(s) busy while this script slept"))

    counter = HoldableCounter()
    x = jnp.float32(0)
    loops = {
        "no tap": jax.jit(lambda x: lax.fori_loop(0, args.steps, lambda i, c: c + 1, x)),
        "tapped": jax.jit(lambda x: lax.fori_loop(
            0, args.steps, lambda i, c: hcb.id_tap(counter, c + 1), x)),
    }
    for loop in loops.values():  # compile and warm up (the buffer pool too)
        loop(x).block_until_ready()
    hcb.barrier_wait()

    # Per mode: best wall time, best CPU time, and the switches of the round with the best wall.
    best = {name: [float("inf"), float("inf"), None] for name in ("no tap", "delivering", "held")}
    for _ in range(args.repeats):
        for name, times in best.items():
            loop = loops["no tap" if name == "no tap" else "tapped"]
            counter.taps = 0
            try:
                if name == "held":
                    counter.released.clear()
                switches_before, cpu_before = context_switches(), device_cpu_seconds()
                start = time.perf_counter()
                loop(x).block_until_ready()
                wall = time.perf_counter() - start
                switches_after, cpu_after = context_switches(), device_cpu_seconds()
            finally:
                counter.released.set()
            hcb.barrier_wait()
            expected = 0 if name == "no tap" else args.steps
            if counter.taps != expected:
                raise AssertionError(f"{name}: {counter.taps} taps delivered, expected {expected}")
            if wall < times[0] and switches_before is not None:
                times[2] = tuple(b - a for a, b in zip(switches_before, switches_after))
            times[0] = min(times[0], wall)
            if cpu_before is not None:
                times[1] = min(times[1], cpu_after - cpu_before)

    base_wall, base_cpu, _ = best["no tap"]
    print(f"\n{args.steps:,} steps tapping 4 bytes each, jit, best of {args.repeats} "
          f"(loop without taps: {base_wall * 1e3:.1f} ms)")
    print(f"{'receiver':<12}{'wall us/tap':>13}{'CPU us/tap':>12}{'switches (vol., invol.)':>25}")
    out = {"busy_cores": busy}
    for name in ("delivering", "held"):
        wall, cpu, switches = best[name]
        wall_us = (wall - base_wall) / args.steps * 1e6
        cpu_us = None if cpu == float("inf") else (cpu - base_cpu) / args.steps * 1e6
        print(f"{name:<12}{wall_us:>13.3f}{'n/a' if cpu_us is None else f'{cpu_us:.3f}':>12}"
              f"{'n/a' if switches is None else f'{switches[0]}, {switches[1]}':>25}")
        out[name] = {"wall_us": wall_us, "cpu_us": cpu_us, "switches": switches}
    return out


if __name__ == "__main__":
    main()
