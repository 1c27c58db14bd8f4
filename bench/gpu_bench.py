"""hostcallback on a CUDA GPU against JAX's own callback, variants alternated in one run (best of
--repeats rounds).

Taps: a scan of N steps tapping 4 bytes (--small N) or 4 MiB (--large N) a step, with no tap,
hostcallback's native transport (the GPU tap handler), its callback transport (JAX's host
callback underneath) and jax.debug.callback:
  device us/tap   (time until the computation finished - the scan without taps) / taps: what a
                  tap costs the device's stream
  records/s, GB/s taps and bytes handled by the consumer per second, until the last was handled
  vs debug        jax.debug.callback's device cost divided by this one's (higher is better)
The copy row is the device-to-host copy speed of 4 MiB by jax.device_get and, where CuPy is at
hand, into page-locked memory as a tap copies: the ceiling a tap's copy can reach.

Training step: an MLP of --layers matmuls (width --width, batch --batch), grad and SGD update,
--steps steps back to back: without taps, with a loss tap, and with the loss and each layer's
gradient norm tapped (hostcallback native, callback transport, jax.debug.callback), all with
delivery="async", and with the loss tapped natively in the default delivery (results ready once
the taps were handled: the stream waits at the step's end); "+%" is the step time over the step
without taps.

Usage: python bench/gpu_bench.py [--small N] [--large N] [--repeats R] [--steps S] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import hostcallback as hcb

VARIANTS = ("none", "native", "callback", "debug")


def _tapper(variant: str, sink):
    """Taps x by the variant's means; None for no tap."""
    if variant == "debug":
        return lambda x: jax.debug.callback(sink, x)
    if variant in ("native", "callback"):
        return lambda x: hcb.id_tap(lambda v, _: sink(v), x)
    return None


def _compiled(variant: str, fn, args: tuple, delivery: str = "async"):
    """fn compiled for args with the variant's transport and delivery, which a tap takes when it
    is traced and lowered: here, inside the settings (a jax.jit traces at its first call)."""
    with hcb.config.override(transport="callback" if variant == "callback" else "native",
                             delivery=delivery):
        return jax.jit(fn).lower(*args).compile()


def tap_scan(variant: str, steps: int, elements: int):
    counter = [0]

    def sink(v):
        counter[0] += 1

    tap = _tapper(variant, sink)

    def run(x):
        def body(c, i):
            # A new value each step, carried on, so that the scan without taps runs the same
            # loop: XLA can neither hoist it nor drop it.
            value = c + i.astype(c.dtype)
            if tap is not None:
                tap(value)
            return value, None
        return jax.lax.scan(body, x, jnp.arange(steps))[0]

    x = jax.device_put(jnp.zeros((elements,), jnp.float32) if elements > 1 else
                       jnp.float32(0))
    f = _compiled(variant, run, (x,))
    f(x).block_until_ready()
    hcb.barrier_wait()
    jax.effects_barrier()

    def once():
        counter[0] = 0
        start = time.perf_counter()
        f(x).block_until_ready()
        device = time.perf_counter() - start
        if variant in ("native", "callback"):
            hcb.barrier_wait()
        else:
            jax.effects_barrier()
        handled = time.perf_counter() - start
        assert variant == "none" or counter[0] == steps, (variant, counter[0], steps)
        return device, handled

    return once


def copy_speed(elements: int, repeats: int) -> dict:
    """GB/s of device-to-host copies of the tap's size: jax.device_get of a fresh array each time
    (an array keeps its host copy once fetched), and, where CuPy is at hand, one copy into
    page-locked memory, what a tap's copy does: its ceiling."""
    x = jax.device_put(jnp.ones((elements,), jnp.float32))
    best = float("inf")
    for i in range(repeats * 5):
        fresh = (x + i).block_until_ready()
        start = time.perf_counter()
        np.asarray(jax.device_get(fresh))
        best = min(best, time.perf_counter() - start)
    speeds = {"device_get": elements * 4 / best / 1e9}
    try:
        import cupy
    except ImportError:
        return speeds
    source = cupy.ones((elements,), cupy.float32)
    pinned = cupy.cuda.alloc_pinned_memory(elements * 4)
    stream = cupy.cuda.Stream(non_blocking=True)
    best = float("inf")
    for _ in range(repeats * 5):
        start = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(pinned.ptr, source.data.ptr, elements * 4,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()
        best = min(best, time.perf_counter() - start)
    speeds["pinned"] = elements * 4 / best / 1e9
    return speeds


def tap_table(name: str, steps: int, elements: int, repeats: int) -> dict:
    runs = {v: tap_scan(v, steps, elements) for v in VARIANTS}
    best = {v: (float("inf"), float("inf")) for v in VARIANTS}
    for _ in range(repeats):
        for v in VARIANTS:
            device, handled = runs[v]()
            best[v] = (min(best[v][0], device), min(best[v][1], handled))
    base = best["none"][0]
    cost = {v: max(best[v][0] - base, 1e-9) / steps * 1e6 for v in VARIANTS if v != "none"}
    out = {}
    print(f"\n{name}: {steps} taps of {elements * 4} B")
    print(f"  {'variant':10s} {'device us/tap':>14s} {'records/s':>12s} {'GB/s':>8s} "
          f"{'vs debug':>9s}")
    for v in ("native", "callback", "debug"):
        rate = steps / best[v][1]
        gbs = rate * elements * 4 / 1e9
        ratio = cost["debug"] / cost[v]
        out[v] = {"device_us_per_tap": cost[v], "records_per_s": rate, "gb_per_s": gbs,
                  "vs_debug": ratio}
        print(f"  {v:10s} {cost[v]:14.2f} {rate:12.0f} {gbs:8.2f} {ratio:9.1f}x")
    return out


def mlp_step(variant: str, grad_norms: bool, args: tuple, delivery: str = "async"):
    counter = [0]

    def sink(v):
        counter[0] += 1

    tap = _tapper(variant, sink)

    def loss_fn(params, x):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h * h)

    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        if tap is not None:
            tap(loss)
            if grad_norms:
                for g in grads:
                    tap(jnp.sqrt(jnp.sum(g * g)))
        return [p - 1e-3 * g for p, g in zip(params, grads)]

    return _compiled(variant, step, args, delivery), counter


def step_table(layers: int, width: int, batch: int, steps: int, repeats: int) -> dict:
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params0 = [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width)
               for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (batch, width), jnp.float32)
    variants = [("none", False)] + [(v, g) for g in (False, True)
                                    for v in ("native", "callback", "debug")]
    variants.append(("native", "handled"))  # a loss tap, results ready once it was handled
    steps_of = {key: mlp_step(key[0], key[1] is True, (params0, x),
                              "handled" if key[1] == "handled" else "async")
                for key in variants}

    def once(key):
        f, counter = steps_of[key]
        params = params0
        start = time.perf_counter()
        for _ in range(steps):
            params = f(params, x)
        jax.block_until_ready(params)
        elapsed = time.perf_counter() - start
        if key[0] != "none":
            hcb.barrier_wait()
            jax.effects_barrier()
        return elapsed / steps

    for key in variants:
        once(key)  # compiled and warm
    best = {key: float("inf") for key in variants}
    for _ in range(repeats):
        for key in variants:
            best[key] = min(best[key], once(key))
    base = best[("none", False)]
    print(f"\ntraining step: {layers} layers of {width}, batch {batch}, {steps} steps")
    print(f"  {'variant':34s} {'ms/step':>9s} {'+%':>7s}")
    print(f"  {'no taps':34s} {base * 1e3:9.3f}")
    out = {"none_ms": base * 1e3}
    for key in variants[1:]:
        name = f"{key[0]}, " + {True: "loss + grad norms", False: "loss",
                                 "handled": "loss, ready once handled"}[key[1]]
        extra = (best[key] / base - 1) * 100
        out[name] = {"ms": best[key] * 1e3, "extra_percent": extra}
        print(f"  {name:34s} {best[key] * 1e3:9.3f} {extra:7.1f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"{device.device_kind} ({device.platform}), JAX {jax.__version__}")
    results = {"device": device.device_kind, "jax": jax.__version__}
    results["small"] = tap_table("small taps", args.small, 1, args.repeats)
    results["large"] = tap_table("4 MiB taps", args.large, 1 << 20, args.repeats)
    copies = copy_speed(1 << 20, args.repeats)
    results["copy_gb_per_s"] = copies.get("pinned", copies["device_get"])
    print(f"  copy of 4 MiB: jax.device_get {copies['device_get']:.2f} GB/s"
          + (f", into page-locked memory {copies['pinned']:.2f} GB/s" if "pinned" in copies
             else " (CuPy absent: no page-locked figure)"))
    results["step"] = step_table(args.layers, args.width, args.batch, args.steps, args.repeats)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
