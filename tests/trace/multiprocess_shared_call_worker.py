"""One process of the shared-call failure test (test_multiprocess_sharded.py).

Usage: python multiprocess_shared_call_worker.py COORDINATOR_PORT PROCESS_ID
Joins a 2-process JAX cluster on localhost (2 CPU devices each) and fails one function's call
shared over the 4 devices twice: first called from device_index 0 (on process 0), then from
device_index 3 (on process 1). Prints, for each, which process's reason its error names.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

coordinator_port, process_id = map(int, sys.argv[1:3])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{coordinator_port}",
                           num_processes=2, process_id=process_id)

import hostcallback as hcb

mesh = jax.make_mesh((4,), ("d",))


def fails(v):
    raise ValueError(f"raised in process {jax.process_index()}")


with jax.set_mesh(mesh):
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("d")),
                                     lambda index: np.arange(8, dtype=np.float32)[index])
    for device_index in (0, 3):
        step = jax.jit(lambda x, device_index=device_index: hcb.call(
            fails, x, result_shape=x, device_index=device_index))
        try:
            step(x).block_until_ready()
            print(f"called from device_index {device_index}: no error", flush=True)
        except Exception as error:  # noqa: BLE001 - which reason it names is what is printed
            names = [f"process {p}" for p in (0, 1) if f"raised in process {p}" in str(error)]
            if "a device of another process" in str(error):
                names.append("another process")
            print(f"called from device_index {device_index}: {' and '.join(names)}", flush=True)
    # Neither leaves while the other still runs: a sum over the four devices, waited for on both
    # of this process's devices. (multihost_utils.sync_global_devices waits for one of them: the
    # other's part of its collective could still be connecting to the other process as this one
    # left, and that process then waited for it forever.)
    jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x).block_until_ready()
print("done", process_id, flush=True)
jax.distributed.shutdown()
