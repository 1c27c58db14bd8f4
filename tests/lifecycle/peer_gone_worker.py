"""One process of the peer-gone exit test (test_exit_and_stop.py).

Usage: python peer_gone_worker.py COORDINATOR_PORT PROCESS_ID
Joins a 2-process JAX cluster on localhost (2 CPU devices each) and runs a sharded step that taps
its loss, blocking on each, until a Ctrl-C; prints "running" after the first step.
"""

import signal
import sys

signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive run has it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

coordinator_port, process_id = map(int, sys.argv[1:3])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{coordinator_port}",
                           num_processes=2, process_id=process_id)

import hostcallback as hcb  # noqa: E402

mesh = jax.make_mesh((4,), ("d",))
step = jax.jit(lambda x: x + hcb.id_tap(lambda v, t: None, jnp.mean(x)))
with jax.set_mesh(mesh):
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("d")),
                                     lambda index: np.arange(8, dtype=np.float32)[index])
    x = step(x).block_until_ready()
    print("running", flush=True)
    while True:
        x = step(x).block_until_ready()
