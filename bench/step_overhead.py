"""What a tap compiled into a training step costs the step, against jax.debug.callback.

A small MLP step (64 x 256 inputs, 256 x 256 weights) is run back to back, its results fed to the
next step, the way a training loop runs. Variants: no tap; a tap of the loss that fires every step;
a tap of the loss and the 256 KiB gradient every step; a tap inside a cond that never fires (what
every 'print every N steps' costs on the other steps) beside the same cond without a tap (what
XLA's conditional costs by itself); each for hostcallback (default and ordered=True, and the
callback transport, which GPU and TPU run today) and jax.debug.callback. By default a step's
results are ready only once its taps were handled; "hostcallback async" is the same tap with
delivery="async", where they are ready at once.

"added %" is the cost relative to the step without a tap: the median over the rounds of each
round's ratio, with the quartiles of those ratios beside it to show how much the machine moved it.
"receiver us" is the CPU time hostcallback's receiver threads spent per step (waking, draining,
calling the consumer): work that competes with the step for the machine's cores, and a figure
that, unlike wall time, a noisy machine hardly moves (each round ends with a barrier_wait, whose
own share every row carries, as the untapped row shows). JAX's callbacks run on the device's own
thread, so they have none.

Usage: python bench/step_overhead.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from receiver_cpu import receiver_cpu_seconds

import hostcallback as hcb
from hostcallback import config


def discard(*args):
    return None


def on_callback_transport(tap):
    """The same tap, traced (and so lowered) on the callback transport."""
    def traced(loss, g):
        with config.override(transport="callback"):
            return tap(loss, g)
    return traced


def make_step(tap, uses_result=False):
    x = jnp.ones((64, 256))

    @jax.jit
    def step(w):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        result = tap(loss, g)
        # The control's cond must be used, or JAX would drop it; a tap stays by itself.
        return w - 0.01 * g + (result if uses_result else 0)

    return step


CONTROL = "jax cond, no tap (control)"
# Variants compiled with delivery="async": results ready at once, taps following (what every
# variant was before ready-means-handled); the others end each step once its taps were handled.
ASYNC = {"hostcallback async, every step"}
TAPS = {
    "no tap": lambda loss, g: None,
    "hostcallback, every step": lambda loss, g: hcb.id_tap(discard, loss),
    "hostcallback, loss + grad": lambda loss, g: hcb.id_tap(discard, (loss, g)),
    CONTROL: lambda loss, g: lax.cond(
        loss < -1, lambda: jnp.sum(g), lambda: jnp.float32(0)),
    "hostcallback, never fires": lambda loss, g: lax.cond(
        loss < -1, lambda: (hcb.id_tap(discard, loss), None)[1], lambda: None),
    "hostcallback ordered, every step": lambda loss, g: hcb.id_tap(discard, loss, ordered=True),
    "hostcallback ordered, never fires": lambda loss, g: lax.cond(
        loss < -1, lambda: (hcb.id_tap(discard, loss, ordered=True), None)[1], lambda: None),
    "hostcallback async, every step": lambda loss, g: hcb.id_tap(discard, loss),
    "callback transport, every step": on_callback_transport(
        lambda loss, g: hcb.id_tap(discard, loss)),
    "callback transport, never fires": on_callback_transport(lambda loss, g: lax.cond(
        loss < -1, lambda: (hcb.id_tap(discard, loss), None)[1], lambda: None)),
    "debug.callback, every step": lambda loss, g: jax.debug.callback(discard, loss),
    "debug.callback, loss + grad": lambda loss, g: jax.debug.callback(discard, (loss, g)),
    "debug.callback, never fires": lambda loss, g: lax.cond(
        loss < -1, lambda: jax.debug.callback(discard, loss), lambda: None),
}


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the spread needs two rounds")
    steps = {name: make_step(tap, uses_result=name == CONTROL) for name, tap in TAPS.items()}
    w0 = jnp.ones((256, 256)) * 0.01
    for name, step in steps.items():  # compiled here, each with its delivery
        with config.override(delivery="async" if name in ASYNC else "handled"):
            step(w0).block_until_ready()
    hcb.barrier_wait()
    times: dict[str, list[float]] = {name: [] for name in steps}
    receiver = dict.fromkeys(steps, 0.0)
    order = list(steps)
    shuffle = random.Random(0).shuffle
    for _ in range(args.rounds):  # interleaved, so that machine noise hits every variant alike
        shuffle(order)  # and in a new order each round, so that no variant always follows another
        for name in order:
            step = steps[name]
            w = w0
            cpu_before = receiver_cpu_seconds()
            start = time.perf_counter()
            for _ in range(args.steps):
                w = step(w)
            w.block_until_ready()
            times[name].append((time.perf_counter() - start) / args.steps)
            hcb.barrier_wait()  # this variant's records are handled before the next one runs
            receiver[name] += receiver_cpu_seconds() - cpu_before
    jax.effects_barrier()
    # Each round's variant against the same round's step without a tap: the median of those
    # ratios, with their quartiles as the spread, is what a drifting machine moves least.
    base = times["no tap"]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.rounds} rounds of "
          f"{args.steps} steps; medians, added % with its quartiles over the rounds")
    print(f"{'variant':<36}{'us/step':>10}{'added %':>9}{'quartiles':>17}{'receiver us':>13}")
    added = {}
    for name, seconds in times.items():
        q1, median, q3 = statistics.quantiles(
            [t / b - 1 for t, b in zip(seconds, base)], n=4, method="inclusive")
        added[name] = median
        cpu = ("" if name.startswith("debug.") else
               f"{receiver[name] / (args.rounds * args.steps) * 1e6:.1f}")
        print(f"{name:<36}{statistics.median(seconds) * 1e6:>10.1f}{median:>9.1%}"
              f"{f'{q1:.1%} .. {q3:.1%}':>17}{cpu:>13}")
    return added


if __name__ == "__main__":
    main()
