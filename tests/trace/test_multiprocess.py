"""Two processes joined with jax.distributed on localhost stream their taps to one collector,
which restarts mid-run."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port
from hostcallback.consumer import read_records
from hostcallback.consumer.collector import CollectorThread

WORKER = Path(__file__).with_name("multiprocess_worker.py")
STEPS = 50


@pytest.mark.timeout(300)
def test_every_process_device_and_step_arrives_exactly_once_across_a_collector_restart(tmp_path):
    port = free_port()
    server = CollectorThread(tmp_path / "collected", port=port).start()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    coordinator = free_port()
    try:
        workers = [subprocess.Popen(
            [sys.executable, str(WORKER), str(coordinator), str(process), str(port), str(STEPS),
             "0.04"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for process in range(2)]
        deadline = time.monotonic() + 240
        while server.collector.records_written < 20 and time.monotonic() < deadline:
            assert all(w.poll() is None for w in workers), "a worker ended before the restart"
            time.sleep(0.01)
        server.stop()  # mid-run: the workers keep tapping while no collector listens
        restarted_at = server.collector.records_written
        server = CollectorThread(tmp_path / "collected", port=port).start()
        outputs = [worker.communicate(timeout=240)[0] for worker in workers]
        assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
        records = list(read_records(server.collector.path_for("multiprocess")))
    finally:
        server.stop()
    assert 20 <= restarted_at < 4 * STEPS  # the restart happened mid-run
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
