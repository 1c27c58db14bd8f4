"""Two processes x two devices, a sharded jit step (no shard_map), both transports: every
(process, device, step) record reaches one collector exactly once, with the right values; a
call shared over the devices of both processes fails everywhere with its own reason."""

from pathlib import Path

import numpy as np
import pytest

from helpers import run_cluster, run_jax_processes

WORKER = Path(__file__).with_name("multiprocess_sharded_worker.py")
SHARED_CALL_WORKER = Path(__file__).with_name("multiprocess_shared_call_worker.py")
STEPS = 20
EXPECTED_RECORDS = STEPS * (1 + 1 + 4)  # two whole-value taps and four shards per step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["native", "callback"])
@pytest.mark.needs_internals("taps in a jit over a sharded mesh and partitioned=True")
def test_sharded_jit_taps_reach_the_collector_exactly_once(tmp_path, transport):
    records = run_cluster(tmp_path, WORKER, STEPS, transport, "sharded", EXPECTED_RECORDS)
    keys = [(r.name, r.process, r.device_id, r.step) for r in records]
    assert len(keys) == len(set(keys)) == EXPECTED_RECORDS
    # Device ids are global: 0 and 1 on process 0, 2048 and 2049 on process 1 (XLA's CPU client).
    position = {0: 0, 1: 1, 2048: 2, 2049: 3}
    for name, process, device in (("whole@0", 0, 0), ("whole@3", 1, 2049)):
        whole = sorted((r for r in records if r.name == name), key=lambda r: r.step)
        assert [(r.process, r.device_id) for r in whole] == [(process, device)] * STEPS
        for step, record in enumerate(whole):
            np.testing.assert_array_equal(record.value["x"], np.arange(8) + step)
    shards = [r for r in records if r.name == "shard"]
    assert {(r.process, r.device_id) for r in shards} == {(0, 0), (0, 1), (1, 2048), (1, 2049)}
    for record in shards:
        _step_offset, (offset,) = record.transforms[-1][1]["offset"]  # leaves: step, x
        expected = np.arange(offset, offset + 2) + record.step
        np.testing.assert_array_equal(record.value["x"], expected)
        assert offset == 2 * position[record.device_id]  # each device tapped its own shard


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["native", "callback"])
@pytest.mark.needs_internals("calls in a jit over a sharded mesh")
def test_a_shared_call_failing_in_either_process_names_its_own_reason_never_an_earlier_one(
        transport):
    outputs = run_jax_processes(SHARED_CALL_WORKER, transport=transport)
    said = [[line for line in output.splitlines() if line.startswith("called from")]
            for output in outputs]
    # The process whose device called names the reason; the other says where to look, also
    # where an earlier failure of the same call left a reason of its own behind.
    assert said[0] == ["called from device_index 0: process 0",
                       "called from device_index 3: another process"], outputs[0]
    assert said[1] == ["called from device_index 0: another process",
                       "called from device_index 3: process 1"], outputs[1]
