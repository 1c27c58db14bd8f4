"""What a progress bar adds to a 100k-step fori_loop: ours against jax-tqdm and against no bar.

One jitted ``lax.fori_loop`` of N steps over a scalar, run back to back in rounds, variants
interleaved; the best of the rounds is reported (on a shared machine the median moves by more than
what is measured). Variants: no bar; jax-tqdm's ``loop_tqdm`` (its default update every N/20
steps), with JAX's lowering of its ``jax.debug.callback`` calls and served by hostcallback
(compiled with ``serve_jax_callbacks()`` on, its code unchanged); our ``loop_progress`` decorator
(same calling convention, every N/20 steps); our ``progress_fori_loop`` (the loop in chunks, a tap
between chunks) every N/20 and N/100 steps. Every bar renders to memory (tqdm into a StringIO), so
the terminal is not what is measured. Two times per variant: until the result is ready, and until
the bar has seen the last step too (``ProgressSink.wait()`` for ours, ``jax.effects_barrier()`` for
jax-tqdm). A last row shows what an ``hcb.barrier_wait()`` with nothing to wait for costs, for
comparison.

jax-tqdm is not a dependency of hostcallback: ``pip install jax-tqdm`` for its rows.

Usage: python bench/progress_overhead.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import io
import time

import jax
import jax.numpy as jnp
from jax import lax

import hostcallback as hcb
from hostcallback.consumer import ProgressSink, loop_progress, progress_fori_loop


def body(i, x):
    return x * 0.9999 + jnp.sin(x + i) * 1e-3


# The variants compiled with JAX's callbacks served by hostcallback (serve_jax_callbacks).
SERVED = {"jax-tqdm loop_tqdm, every N/20, served"}


def variants(n: int) -> dict[str, tuple]:
    """name -> (jitted loop, what waits for the bar)."""
    def bar():
        return ProgressSink(total=n, bar=True, file=io.StringIO())

    out = {"no bar": (jax.jit(lambda x: lax.fori_loop(0, n, body, x)), None)}
    try:
        from jax_tqdm import loop_tqdm

        for name in ("jax-tqdm loop_tqdm, every N/20", *SERVED):
            tqdm_body = loop_tqdm(n, file=io.StringIO())(body)
            out[name] = (jax.jit(lambda x, b=tqdm_body: lax.fori_loop(0, n, b, x)),
                         jax.effects_barrier)
    except ImportError:
        print("jax-tqdm is not installed (pip install jax-tqdm): its rows are left out\n")
    ours = loop_progress(n, every=max(1, n // 20), sink=bar())(body)
    out["ours, loop_progress decorator, every N/20"] = (
        jax.jit(lambda x: lax.fori_loop(0, n, ours, x)), ours.progress_sink.wait)
    for parts in (20, 100):
        sink = bar()
        out[f"ours, progress_fori_loop, every N/{parts}"] = (
            jax.jit(lambda x, s=sink, p=parts: progress_fori_loop(0, n, body, x,
                                                                  every=max(1, n // p), sink=s)),
            sink.wait)
    return out


def _timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main(argv=None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    loops = variants(args.steps)
    x0 = jnp.float32(0.5)
    for name, (loop, wait) in loops.items():  # compile and warm up
        hcb.serve_jax_callbacks(name in SERVED)
        loop(x0).block_until_ready()
        if wait:
            wait()
    hcb.serve_jax_callbacks(False)
    ready: dict[str, list[float]] = {name: [] for name in loops}
    done: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, (loop, wait) in loops.items():
            started = time.perf_counter()
            loop(x0).block_until_ready()
            ready[name].append(time.perf_counter() - started)
            if wait:
                wait()
            done[name].append(time.perf_counter() - started)
    best = {name: (min(ready[name]), min(done[name])) for name in loops}
    base_ready, base_done = best["no bar"]
    print(f"{args.steps} steps of fori_loop, best of {args.rounds} rounds "
          f"(no bar: {base_ready * 1e3:.2f} ms)\n")
    print(f"{'variant':<44}{'added, result ready':>22}{'added, bar done':>18}")
    for name, (r, d) in best.items():
        if name != "no bar":
            print(f"{name:<44}{(r - base_ready) * 1e3:>19.3f} ms{(d - base_done) * 1e3:>15.3f} ms")
    hcb.barrier_wait()
    barriers = min(_timed(hcb.barrier_wait) for _ in range(args.rounds))
    print(f"{'(an hcb.barrier_wait() with nothing to wait for)':<66}{barriers * 1e3:>15.3f} ms")
    reference = "jax-tqdm loop_tqdm, every N/20"
    if reference in best:
        print()
        added_tqdm = best[reference][1] - base_done
        for name, (_, d) in best.items():
            if name.startswith("ours") or name in SERVED:
                added = d - base_done
                ratio = added_tqdm / added if added > 0 else float("inf")
                print(f"jax-tqdm adds {ratio:6.1f}x the time of: {name}")
    return best


if __name__ == "__main__":
    main()
