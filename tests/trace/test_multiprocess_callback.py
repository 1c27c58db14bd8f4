"""Two processes joined with jax.distributed, on the callback transport: every process's shard_map
taps reach one collector exactly once, each device with its own shard, in step order."""

from pathlib import Path

import pytest

from helpers import run_cluster

WORKER = Path(__file__).with_name("multiprocess_worker.py")
STEPS = 50


@pytest.mark.timeout(300)
@pytest.mark.needs_internals("the device of callback-transport records")
def test_callback_transport_taps_of_two_processes_arrive_exactly_once(tmp_path):
    records = run_cluster(tmp_path, WORKER, STEPS, "callback", "multiprocess", 4 * STEPS)
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
