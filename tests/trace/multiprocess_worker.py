"""One process of the multi-process test (started by test_multiprocess.py, not collected).

Usage: python multiprocess_worker.py COORDINATOR_PORT PROCESS_ID COLLECTOR STEPS [PAUSE]
Joins a 2-process JAX cluster on localhost (2 CPU devices each), runs a jitted step over the
global 4-device mesh that taps each device's shard, streams the taps to the collector (COLLECTOR:
its port) or to a FileSink (COLLECTOR: a URL, such as s3://bucket/run/{process}.hcbs), and waits
for them with barrier_wait before it exits. PAUSE seconds between steps give the test time to
restart the collector mid-run.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

coordinator_port, process_id, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
collector = sys.argv[3]
pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{coordinator_port}",
                           num_processes=2, process_id=process_id)

import hostcallback as hcb
from hostcallback.consumer import FileSink, SocketSink, tap_to

assert (jax.device_count(), jax.local_device_count()) == (4, 2)
mesh = jax.make_mesh((4,), ("devices",))
x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("devices")),
                                 lambda index: np.arange(4, dtype=np.float32)[index])
sink = FileSink(collector) if "://" in collector else \
    SocketSink("127.0.0.1", int(collector), run="multiprocess")


def step_on_each_device(shard, step):
    tap_to([sink], {"step": step, "shard": shard}, name="shard")
    return shard + 1


step_fn = jax.jit(jax.shard_map(step_on_each_device, mesh=mesh, in_specs=(P("devices"), P()),
                                out_specs=P("devices")))
for step in range(steps):
    x = step_fn(x, jnp.int32(step))
    time.sleep(pause)
hcb.barrier_wait()
sink.close()
print("done", process_id, flush=True)
