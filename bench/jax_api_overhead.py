"""What a callback costs the computation: JAX's jax.debug.callback, jax.debug.print and
io_callback with JAX's lowering ("JAX") and served by hostcallback (the switch,
serve_jax_callbacks: "served"), against hostcallback.debug.callback, hostcallback.debug.print and
hostcallback.io_callback (native and callback transports), the same loop in one run.

Workloads, each a fori_loop whose body calls back with its carry every step:
  small:   4-byte float32, jit on one device (--steps)
  large:   4 MiB float32, jit on one device (--large-steps); callbacks only, no print
  pmap:    4-byte float32 on each of 4 devices (--steps / 4 steps)
  sharded: a jit over 4 devices of a sharded 4-element float32 (--steps / 4 steps); the callback
           gets the whole value once a step
  paced:   a step of tens of microseconds (a 150 x 150 product: 66 us here, 15,000 steps/s)
           calling back with a 4-byte value it computed, jit on one device (--steps / 4 steps):
           whether the receiver keeps up with a callback a step at that rate (then the default's
           cost stays the device's own, as the async row's)
Variants run in interleaved rounds (best of --repeats), so a loaded machine slows all alike.
By default a computation's results are ready only once its callbacks ran, so a loop that calls
back every step is bound by the receiver's work as much as by the device's. The "async" rows
compile the same debug callback or print with delivery="async": results are ready when the
device is done and the receiver goes on behind them (its backlog is handled outside the timed
part), so their us/call is the device's own cost, what bench/tap_overhead.py measures for a tap.

  us/call   (time until the computation finished - the loop without callbacks) / calls: what a
            call costs the device
  vs JAX    JAX's own function's us/call divided by this one's (higher is better)

Printing goes to an in-memory stream (sys.stdout is swapped for the measured runs).

Usage: python bench/jax_api_overhead.py [--steps N] [--large-steps N] [--repeats R]
                                        [--workloads small,large,pmap,sharded,paced]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import argparse
import contextlib
import io
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback as jax_io_callback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb

SCALAR = jax.ShapeDtypeStruct((), jnp.float32)


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args) -> None:
        self.calls += 1


def body_for(variant: str, counter: Counter):
    """The loop body: calls back with the carry through ``variant``, returns the next carry."""
    api, _, who = variant.partition(" ")
    ours = who.startswith(("(native", "(callback"))
    debug = hcb.debug if ours else jax.debug
    if api == "none":
        return lambda c: c + 1
    if api == "debug.callback":
        return lambda c: (debug.callback(counter, c), c + 1)[1]
    if api == "debug.print":
        return lambda c: (debug.print("{}", c), c + 1)[1]
    if api == "io_callback":
        io_callback = hcb.io_callback if ours else jax_io_callback
        return lambda c: io_callback(lambda v: counter(v) or np.asarray(v) + 1,
                                     jax.ShapeDtypeStruct(c.shape, jnp.float32), c)
    raise ValueError(variant)


@contextlib.contextmanager
def served():
    """JAX's own callbacks served by hostcallback while the loop is compiled (and run)."""
    hcb.serve_jax_callbacks()
    try:
        yield
    finally:
        hcb.serve_jax_callbacks(False)


@contextlib.contextmanager
def compiled_as(variant: str):
    """The variant's transport (or the switch) and delivery, while it is compiled and run."""
    who = variant.partition(" ")[2]
    with contextlib.ExitStack() as stack:
        if who.startswith("(served"):
            stack.enter_context(served())
        for transport in ("native", "callback"):
            if who.startswith(f"({transport}"):
                stack.enter_context(hcb.config.override(transport=transport))
        if who.endswith(", async)"):
            stack.enter_context(hcb.config.override(delivery="async"))
        yield


def wait_for_delivery() -> None:
    jax.effects_barrier()
    hcb.barrier_wait()


class Run:
    """One variant's compiled loop, run round by round beside the others."""

    def __init__(self, variant: str, workload: str, steps: int, shape: tuple) -> None:
        self.variant, self.counter, self.best = variant, Counter(), float("inf")
        with compiled_as(variant):
            body = body_for(variant, self.counter)
            loop = lambda x: lax.fori_loop(0, steps, lambda i, c: body(c), x)  # noqa: E731
            if workload == "paced":
                weights = jnp.eye(150) * 0.5 + 1e-3
                paced = lambda c: (body(jnp.sum(c)), jnp.tanh(c @ weights))[1]  # noqa: E731
                loop = lambda x: lax.fori_loop(0, steps, lambda i, c: paced(c), x)  # noqa: E731
                self.loop, self.x = jax.jit(loop), jnp.full((150, 150), 0.01, jnp.float32)
            elif workload == "pmap":
                self.loop, self.x = jax.pmap(loop), jnp.zeros((4, *shape), jnp.float32)
            elif workload == "sharded":
                mesh = jax.make_mesh((4,), ("i",))
                self.x = jax.device_put(jnp.zeros((4,), jnp.float32), NamedSharding(mesh, P("i")))
                self.loop = jax.jit(loop)
            else:
                self.loop, self.x = jax.jit(loop), jnp.zeros(shape, jnp.float32)
            self.measure()  # compile and warm up
            self.best = float("inf")

    def measure(self) -> None:
        with compiled_as(self.variant), contextlib.redirect_stdout(io.StringIO()):
            start = time.perf_counter()
            self.loop(self.x).block_until_ready()
            self.best = min(self.best, time.perf_counter() - start)
            wait_for_delivery()


def run_workload(name: str, variants: list[str], steps: int, shape: tuple, repeats: int,
                 calls_per_step: int) -> dict:
    runs = [Run(v, name, steps, shape) for v in ["none", *variants]]
    for _ in range(repeats):
        for run in runs:
            run.measure()
    base = runs[0].best
    cost = {r.variant: (r.best - base) / (steps * calls_per_step) * 1e6 for r in runs[1:]}
    size = int(np.prod(shape)) * 4
    print(f"\n{name}: {steps:,} steps, {size:,} bytes a call, {calls_per_step} call(s) a step "
          f"(loop without callbacks: {base * 1e3:.1f} ms, {steps / base:,.0f} steps/s)")
    print(f"{'variant':<34}{'us/call':>10}{'vs JAX':>10}")
    for variant, us in cost.items():
        theirs = cost.get(variant.split(" ")[0] + " (JAX)")
        # (at or under the loop without callbacks: within the machine's noise, no ratio)
        ratio = ("" if theirs is None or variant.endswith("(JAX)") or min(us, theirs) <= 0.01
                 else f"{theirs / us:.1f}x")
        print(f"{variant:<34}{us:>10.3f}{ratio:>10}")
    return cost


# name: (APIs it runs, which step count, shape of the value, calls a step)
WORKLOADS = {
    "small": (["debug.callback", "debug.print", "io_callback"], "steps", (), 1),
    "large": (["debug.callback", "io_callback"], "large_steps", (1 << 20,), 1),
    "pmap": (["debug.callback", "debug.print"], "steps/4", (), 4),
    "sharded": (["debug.callback", "debug.print", "io_callback"], "steps/4", (), 1),
    "paced": (["debug.callback"], "steps/4", (), 1),
}


def variants(apis: list[str]) -> list[str]:
    """Each API's variants; a debug callback's or print's also compiled with delivery="async"
    (an io_callback waits for its answer either way)."""
    return [f"{api} {who}" for api in apis
            for who in ("(JAX)", "(served)", "(native)", "(callback)")
            + (("(served, async)", "(native, async)") if api.startswith("debug.") else ())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--large-steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="which workloads to run, comma-separated (default: all)")
    args = parser.parse_args()
    chosen = set(args.workloads.split(","))
    if unknown := chosen - WORKLOADS.keys():
        parser.error(f"unknown workloads {sorted(unknown)}; known: {sorted(WORKLOADS)}")
    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    steps = {"steps": args.steps, "large_steps": args.large_steps, "steps/4": args.steps // 4}
    for name, (apis, step_count, shape, calls_per_step) in WORKLOADS.items():
        if name in chosen:
            run_workload(name, variants(apis), steps[step_count], shape, args.repeats,
                         calls_per_step)


if __name__ == "__main__":
    main()
