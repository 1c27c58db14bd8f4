"""The demo (``python -m hostcallback demo``): a small jitted training loop whose loss and
gradient norm reach the host every step.

Nothing in the step waits for the host: the tap only copies three scalars into the outfeed queue,
and a receiver thread prints them and appends them to a record stream while the next steps run.
After training the demo draws the loss curve from that stream (when matplotlib is installed).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import hostcallback as hcb

from . import FileSink, Sink, tap_to
from .__main__ import plot


def make_data(key, samples: int = 512, features: int = 16):
    """A synthetic regression problem: y = tanh(x @ w_true) plus a little noise."""
    x_key, w_key, noise_key = jax.random.split(key, 3)
    x = jax.random.normal(x_key, (samples, features))
    w_true = jax.random.normal(w_key, (features, 1))
    y = jnp.tanh(x @ w_true) + 0.05 * jax.random.normal(noise_key, (samples, 1))
    return x, y


def init_params(key, features: int = 16, hidden: int = 32):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (features, hidden)) / np.sqrt(features),
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 1)) / np.sqrt(hidden),
            "b2": jnp.zeros(1)}


def loss_fn(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


class ProgressPrinter(Sink):
    """A sink of our own: one line per training step."""

    def __init__(self) -> None:
        self.lines = 0

    def emit(self, record) -> None:
        metrics = record.value
        print(f"step {int(metrics['step']):4d}   loss {float(metrics['loss']):.5f}   "
              f"grad_norm {float(metrics['grad_norm']):.5f}", flush=True)
        self.lines += 1


def make_train_step(sinks, learning_rate: float = 0.1):
    @jax.jit
    def train_step(params, step, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grad_norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree_util.tree_leaves(grads)))
        tap_to(sinks, {"step": step, "loss": loss, "grad_norm": grad_norm}, name="train")
        params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads)
        return params, step + 1

    return train_step


def run(steps: int = 200, out_dir: str = "hostcallback-demo") -> ProgressPrinter:
    key = jax.random.key(0)
    data_key, init_key = jax.random.split(key)
    x, y = make_data(data_key)
    params = init_params(init_key)
    printer = ProgressPrinter()
    stream_path = os.path.join(out_dir, "train.hcbs")
    if os.path.exists(stream_path):
        os.remove(stream_path)  # one run per file, so that the plot shows this run
    stream = FileSink(stream_path)
    train_step = make_train_step([printer, stream])
    step = jnp.int32(0)
    started = time.perf_counter()
    for _ in range(steps):
        params, step = train_step(params, step, x, y)
    jax.block_until_ready(params)
    computed = time.perf_counter() - started
    hcb.barrier_wait()  # every tapped step has been printed and written once this returns
    stream.close()
    print(f"{steps} steps computed in {computed:.2f} s; {printer.lines} steps reported; "
          f"final loss {float(loss_fn(params, x, y)):.5f}")
    print(f"record stream: {stream_path}  (python -m hostcallback.consumer stats {stream_path})")
    plot_path = os.path.join(out_dir, "loss.png")
    if plot(stream_path, "train.loss", plot_path) == 0:
        print(f"loss plot: {plot_path}")
    return printer
