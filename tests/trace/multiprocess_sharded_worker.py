"""One process of the sharded multi-process test (started by test_multiprocess_sharded.py).

Usage: python multiprocess_sharded_worker.py COORDINATOR_PORT PROCESS_ID COLLECTOR_PORT STEPS
Joins a 2-process JAX cluster on localhost (2 CPU devices each) and runs a sharded jit step, as
JAX teaches it (jax.set_mesh, no shard_map), that taps the whole value from device_index 0 (on
process 0) and from device_index 3 (on process 1), and each device's shard with partitioned=True;
every tap streams to one collector. Each step waits for the one before (see the loop).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

coordinator_port, process_id, collector_port, steps = map(int, sys.argv[1:5])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{coordinator_port}",
                           num_processes=2, process_id=process_id)

import hostcallback as hcb
from hostcallback.consumer import SinkTap, SocketSink

assert (jax.device_count(), jax.local_device_count()) == (4, 2)
mesh = jax.make_mesh((4,), ("d",))
sink = SocketSink("127.0.0.1", collector_port, run="sharded")
whole_on_0, whole_on_3 = SinkTap([sink], "whole@0"), SinkTap([sink], "whole@3")
shards = SinkTap([sink], "shard")


def step_fn(x, step):
    hcb.id_tap(whole_on_0, {"step": step, "x": x}, device_index=0)
    hcb.id_tap(whole_on_3, {"step": step, "x": x}, device_index=3)
    hcb.id_tap(shards, {"step": jnp.broadcast_to(step, x.shape), "x": x}, partitioned=True)
    return x + 1


with jax.set_mesh(mesh):
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("d")),
                                     lambda index: np.arange(8, dtype=np.float32)[index])
    step_jit = jax.jit(step_fn)
    for step in range(steps):
        # Each step waits for the one before: steps dispatched back to back stopped inside XLA's
        # CPU client in 2 of 6 full-suite runs (docs/architecture.md, JAX inside consumers).
        x = step_jit(x, jnp.int32(step)).block_until_ready()
hcb.barrier_wait()
sink.close()
print("done", process_id, flush=True)
