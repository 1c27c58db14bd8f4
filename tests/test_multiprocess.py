"""Two processes joined with jax.distributed on localhost stream their taps to one collector."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from consumer import read_records
from consumer.collector import CollectorThread

WORKER = Path(__file__).with_name("multiprocess_worker.py")
STEPS = 50


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_process_device_and_step_arrives_exactly_once(tmp_path):
    server = CollectorThread(tmp_path / "collected").start()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    coordinator = free_port()
    try:
        workers = [subprocess.Popen(
            [sys.executable, str(WORKER), str(coordinator), str(process), str(server.port),
             str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for process in range(2)]
        outputs = [worker.communicate(timeout=240)[0] for worker in workers]
        assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
        deadline = time.monotonic() + 10
        while server.collector.records_written < 4 * STEPS and time.monotonic() < deadline:
            time.sleep(0.05)
        records = list(read_records(server.collector.path_for("multiprocess")))
    finally:
        server.stop()
    keys = [(r.process, r.device_id, r.step) for r in records]
    assert len(keys) == len(set(keys)) == 4 * STEPS  # exactly once each
    for process in (0, 1):
        devices = {device for p, device, _ in keys if p == process}
        assert len(devices) == 2
        assert {(d, s) for p, d, s in keys if p == process} == {
            (d, s) for d in devices for s in range(STEPS)}
    assert {r.source.rsplit("/", 1)[-1] for r in records} == {"p0", "p1"}
    shards = {(r.process, r.device_id): [] for r in records}
    for record in sorted(records, key=lambda r: r.step):
        shards[(record.process, record.device_id)].append(float(record.value["shard"][0]))
    starts = sorted(values[0] for values in shards.values())
    assert starts == [0.0, 1.0, 2.0, 3.0]  # each device tapped its own shard
    for values in shards.values():
        assert values == [values[0] + step for step in range(STEPS)]
