"""Two processes joined with jax.distributed, on the callback transport: every process's shard_map
taps reach one collector exactly once, each device with its own shard, in step order."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from consumer import read_records
from consumer.collector import CollectorThread
from tests.test_multiprocess import free_port

WORKER = Path(__file__).with_name("multiprocess_worker.py")
STEPS = 50


@pytest.mark.timeout(300)
def test_callback_transport_taps_of_two_processes_arrive_exactly_once(tmp_path):
    server = CollectorThread(tmp_path / "collected").start()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               HOSTCALLBACK_TRANSPORT="callback", JAX_PLATFORMS="cpu")
    coordinator = free_port()
    try:
        workers = [subprocess.Popen(
            [sys.executable, str(WORKER), str(coordinator), str(process), str(server.port),
             str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for process in range(2)]
        try:
            outputs = [worker.communicate(timeout=240)[0] for worker in workers]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
        deadline = time.monotonic() + 10
        while server.collector.records_written < 4 * STEPS and time.monotonic() < deadline:
            time.sleep(0.05)
        records = list(read_records(server.collector.path_for("multiprocess")))
    finally:
        server.stop()
    keys = [(r.process, r.device_id, r.step) for r in records]
    assert len(keys) == len(set(keys)) == 4 * STEPS  # exactly once each
    assert {r.process for r in records} == {0, 1}
    shards = {}
    for record in records:  # in arrival order, which per device must be step order
        shards.setdefault((record.process, record.device_id), []).append(
            (record.step, float(record.value["shard"][0])))
    assert len(shards) == 4
    assert sorted(values[0][1] for values in shards.values()) == [0.0, 1.0, 2.0, 3.0]
    for values in shards.values():
        assert [step for step, _ in values] == list(range(STEPS))
        assert [v for _, v in values] == [values[0][1] + step for step in range(STEPS)]
