"""A pod on one machine: a collector with a token and N JAX processes that stream to it.

    python examples/pod_localhost.py --processes 2 --steps 20 --out runs/pod

The launcher writes a random token to a file only you can read, starts the collector
(``hostcallback-consumer collect --port 0 --token-file ...``) and reads the address it prints,
then starts N processes with ``jax.distributed.initialize`` on localhost, each with 2 CPU devices.
Every process runs a sharded training-like step over the global mesh whose tap sends each
device's shard (``partitioned=True``) to the collector through a ``SocketSink``; the token reaches
the workers in HOSTCALLBACK_COLLECTOR_TOKEN, never on a command line. When the workers are done
the launcher stops the collector and checks that every (process, device, step) record arrived
exactly once. On a real pod, start the collector on one host and run the worker part
(``--worker``) on every host with its coordinator address; nothing else changes.

    python examples/pod_localhost.py --to 's3://my-bucket/runs/pod/{process}.hcbs'

writes each process's records to its own stream at that fsspec URL (``FileSink``; needs the
``storage`` extra and the store's package, such as s3fs) instead, with no collector, and reads
them back merged (``hostcallback-consumer tail 's3://my-bucket/runs/pod/*.hcbs'`` does the same).
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

DEVICES_PER_PROCESS = 2


def worker(coordinator: str, processes: int, process_id: int, collector: str | None,
           steps: int, to: str | None = None) -> None:
    """One process of the job: join the cluster, run the sharded steps, stream every shard to
    the collector, or to the stream at URL ``to``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes,
                               process_id=process_id)
    import hostcallback as hcb
    from hostcallback.consumer import FileSink, SocketSink, tap_to

    if to is not None:
        sink = FileSink(to)  # {process} is filled in with this process's index
    else:
        host, port = collector.rsplit(":", 1)
        sink = SocketSink(host, int(port), run="pod")  # the token comes from the environment
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    batch = NamedSharding(mesh, P("batch"))

    @jax.jit
    def step(weights, data, i):  # data arrives split over every device of every process
        loss = jnp.mean((data * weights) ** 2, axis=1)  # one loss per example, split by device
        tap_to([sink], {"step": i, "loss": loss}, name="loss", partitioned=True)
        return weights - 0.1 * jnp.mean(data * loss[:, None], axis=0)

    weights = jnp.ones(4)
    data = jax.make_array_from_callback(
        (4 * jax.device_count(), 4), batch,
        lambda index: jnp.arange(16.0 * jax.device_count()).reshape(-1, 4)[index] / 100)
    for i in range(steps):
        weights = step(weights, data, jnp.int32(i))
    hcb.barrier_wait()  # this process's taps have been handed to the sink
    sink.close()        # and sent to the collector, or written
    print(f"process {process_id}: {steps} steps done", flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_collector(out: Path, token_file: Path) -> tuple[subprocess.Popen, str]:
    """The collector on a free port; returns it and the address it printed (within 60 s)."""
    collector = subprocess.Popen(
        [sys.executable, "-m", "hostcallback.consumer", "collect", "--port", "0", "--out",
         str(out), "--token-file", str(token_file)],
        stdout=subprocess.PIPE, text=True)
    first_line: list[str] = []
    reader = threading.Thread(target=lambda: first_line.append(collector.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(60)
    line = first_line[0] if first_line else ""
    if not line.startswith("collector listening on "):  # e.g. "collector listening on h:p, ..."
        collector.kill()
        raise SystemExit(f"the collector did not start: {line!r}")
    return collector, line.split()[3].rstrip(",")


def write_token(path: Path) -> str:
    """A fresh random token in a file only this user can read (made so, not made then fixed)."""
    token = secrets.token_hex(32)
    if path.is_symlink() or path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")
    return token


def launch(processes: int, steps: int, out: Path, deadline_s: float = 600) -> int:
    out.mkdir(parents=True, exist_ok=True)
    token_file = out / "token"
    token = write_token(token_file)
    collector, address = start_collector(out, token_file)
    workers: list[subprocess.Popen] = []
    try:
        print(f"collector at {address}; {processes} processes of {DEVICES_PER_PROCESS} devices",
              flush=True)
        env = dict(os.environ, HOSTCALLBACK_COLLECTOR_TOKEN=token, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
        coordinator = f"127.0.0.1:{free_port()}"
        for p in range(processes):
            workers.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", str(p), "--coordinator", coordinator,
                 "--processes", str(processes), "--collector", address, "--steps", str(steps)],
                env=env))
        codes = wait_all(workers, deadline_s)
    finally:
        for w in workers:  # one that failed leaves the others waiting for it: end them too
            if w.poll() is None:
                w.kill()
                w.wait()
        collector.send_signal(signal.SIGINT)  # it writes what it has, then stops
        try:
            print(collector.communicate(timeout=60)[0].strip(), flush=True)
        except subprocess.TimeoutExpired:
            collector.kill()
            collector.wait()
    if any(code != 0 for code in codes):
        print(f"workers exited with {codes}", file=sys.stderr)
        return 1
    return check(out / "pod.hcbs", processes, steps)


def launch_to_streams(processes: int, steps: int, to: str, deadline_s: float = 600) -> int:
    """The job without a collector: each process writes its own stream at ``to``."""
    if "{process}" not in to:
        raise SystemExit("--to needs {process} in the URL: each process writes its own stream")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
    coordinator = f"127.0.0.1:{free_port()}"
    workers = [subprocess.Popen(
        [sys.executable, __file__, "--worker", str(p), "--coordinator", coordinator,
         "--processes", str(processes), "--to", to, "--steps", str(steps)], env=env)
        for p in range(processes)]
    try:
        codes = wait_all(workers, deadline_s)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    if any(code != 0 for code in codes):
        print(f"workers exited with {codes}", file=sys.stderr)
        return 1
    from hostcallback.consumer.stream_files import merged_records

    pattern = to.replace("{process}", "*")
    return report(pattern, [(r.process, r.device_id, r.step) for r in merged_records([pattern])],
                  processes, steps)


def wait_all(workers: list[subprocess.Popen], deadline_s: float) -> list[int | None]:
    """Exit codes once all have exited, or as soon as one fails or the deadline passes (None
    for those still running)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        codes = [w.poll() for w in workers]
        if all(code is not None for code in codes) or any(code for code in codes):
            return codes
        time.sleep(0.1)
    return [w.poll() for w in workers]


def check(path: Path, processes: int, steps: int) -> int:
    """Every (process, device, step) exactly once: a record per shard of every step."""
    from hostcallback.consumer import read_records

    return report(path, [(r.source.rsplit("/", 1)[-1], r.device_id, r.step)
                         for r in read_records(path)], processes, steps)


def report(where, keys: list[tuple], processes: int, steps: int) -> int:
    seen = collections.Counter(keys)
    expected = processes * DEVICES_PER_PROCESS * steps
    duplicates = sum(count - 1 for count in seen.values())
    print(f"{where}: {sum(seen.values())} records, {len(seen)} distinct of {expected} expected, "
          f"{duplicates} duplicates")
    return 0 if len(seen) == expected and duplicates == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/pod"))
    parser.add_argument("--worker", type=int, metavar="PROCESS_ID",
                        help="run one worker process (the launcher passes this)")
    parser.add_argument("--coordinator", help="host:port of jax.distributed's coordinator")
    parser.add_argument("--collector", help="host:port of the collector")
    parser.add_argument("--to", metavar="URL",
                        help="no collector: each process writes its own stream at this fsspec "
                        "URL (or path), which must hold {process}")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.coordinator, args.processes, args.worker, args.collector, args.steps,
               to=args.to)
        return 0
    if args.to is not None:
        return launch_to_streams(args.processes, args.steps, args.to)
    return launch(args.processes, args.steps, args.out)


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    if code == 0 and "--worker" not in sys.argv:
        print(f"done in {time.monotonic() - started:.1f} s")
    sys.exit(code)
