"""A real training loop with hostcallback's consumers: TensorBoard, a progress bar, a record
stream and a plot, all fed by taps in one jitted step.

A two-layer MLP (plain JAX) learns a synthetic regression problem with optax's Adam. Each step
taps its loss, the global gradient norm, the norm per layer and the first layer's gradient (a
histogram in TensorBoard); every ``--eval-every`` steps the step also taps the loss on held-out
data. Nothing in the step waits for the host. Run it with::

    pip install '.[examples]'
    python examples/train.py --steps 2000 --out runs/example
    tensorboard --logdir runs/example/tb          # if TensorBoard is installed
    python -m hostcallback.consumer stats runs/example/train.hcbs
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hostcallback as hcb
from hostcallback.consumer import FileSink, ProgressSink, TensorBoardSink, tap_to
from hostcallback.consumer.plotting import plot


def make_data(key, w, samples: int):
    """y = sin(3 x @ w) + noise: smooth enough to learn, hard enough to take a few hundred steps."""
    x_key, noise_key = jax.random.split(key)
    x = jax.random.normal(x_key, (samples, w.shape[0]))
    y = jnp.sin(3 * x @ w) + 0.05 * jax.random.normal(noise_key, (samples, 1))
    return x, y


def init_params(key, features: int = 16, hidden: int = 64):
    k1, k2 = jax.random.split(key)
    return {"layer1": {"w": jax.random.normal(k1, (features, hidden)) * np.sqrt(2 / features),
                       "b": jnp.zeros(hidden)},
            "layer2": {"w": jax.random.normal(k2, (hidden, 1)) / np.sqrt(hidden),
                       "b": jnp.zeros(1)}}


def predict(params, x):
    hidden = jax.nn.gelu(x @ params["layer1"]["w"] + params["layer1"]["b"])
    return hidden @ params["layer2"]["w"] + params["layer2"]["b"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def make_train_step(optimizer, train_sinks, eval_sinks, batch_size: int, eval_every: int):
    @jax.jit
    def train_step(params, opt_state, step, key, data, held_out):
        x, y = data
        index = jax.random.randint(key, (batch_size,), 0, x.shape[0])
        loss, grads = jax.value_and_grad(loss_fn)(params, x[index], y[index])
        tap_to(train_sinks, {
            "step": step, "loss": loss, "grad_norm": optax.global_norm(grads),
            "layer_grad_norm": {name: optax.global_norm(g) for name, g in grads.items()},
            "grads": {"layer1_w": grads["layer1"]["w"]}}, name="train")
        jax.lax.cond(step % eval_every == 0,
                     lambda: tap_to(eval_sinks, {"step": step, "loss": loss_fn(params, *held_out)},
                                    name="eval"),
                     lambda: {"step": step, "loss": loss})
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, step + 1

    return train_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument("--batch-size", type=int, default=128, help="examples per step")
    parser.add_argument("--learning-rate", type=float, default=1e-2,
                        help="Adam's step size (default 0.01)")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="steps between evaluations on held-out data (default 50)")
    parser.add_argument("--out", default="runs/example",
                        help="directory for the stream, the TensorBoard logs and the plot")
    args = parser.parse_args(argv)

    stream_path = os.path.join(args.out, "train.hcbs")
    tb_dir = os.path.join(args.out, "tb")
    for old in (stream_path, tb_dir):  # one run per directory, so the plot shows this run
        if os.path.isdir(old):
            shutil.rmtree(old)
        elif os.path.exists(old):
            os.remove(old)

    stream = FileSink(stream_path)
    board = TensorBoardSink(tb_dir, histograms=["train/grads/*"])
    progress = ProgressSink(total=args.steps, desc="train")
    train_step = make_train_step(optax.adam(args.learning_rate), [stream, board, progress],
                                 [stream, board], args.batch_size, args.eval_every)

    w_key, data_key, held_out_key, init_key, step_key = jax.random.split(jax.random.key(0), 5)
    w = jax.random.normal(w_key, (16, 1)) / 4.0
    data, held_out = make_data(data_key, w, 4096), make_data(held_out_key, w, 1024)
    params = init_params(init_key)
    opt_state = optax.adam(args.learning_rate).init(params)
    step = jnp.int32(0)
    started = time.perf_counter()
    for key in jax.random.split(step_key, args.steps):
        params, opt_state, step = train_step(params, opt_state, step, key, data, held_out)
    jax.block_until_ready(params)
    computed = time.perf_counter() - started
    hcb.barrier_wait()  # every tap is in the stream, the event files and the bar
    for sink in (stream, board, progress):
        sink.close()

    print(f"{args.steps} steps in {computed:.2f} s; held-out loss "
          f"{float(loss_fn(params, *held_out)):.4f}")
    print(f"record stream:   {stream_path}   (python -m hostcallback.consumer stats {stream_path})")
    print(f"TensorBoard:     tensorboard --logdir {tb_dir}")
    plot_path = os.path.join(args.out, "curves.png")
    if plot([stream_path], ["train.loss", "eval.loss", "train.grad_norm"], plot_path,
            logy=True, smoothing=0.6) == 0:
        print(f"plot:            {plot_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
