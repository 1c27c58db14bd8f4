"""A million taps on four devices: each delivered exactly once, in order, memory bounded."""

from conftest import run_python

VOLUME = """
    import resource
    import numpy as np
    import jax
    from jax import lax
    import hostcallback as hcb

    BUDGET = 1 << 20
    hcb.configure(max_queue_bytes=BUDGET)
    per_device = {d.id: [] for d in jax.devices()}

    def record(arg, transforms, device):
        per_device[device.id].append(int(arg))

    steps = 250_000  # times 4 devices: a million taps
    run = jax.pmap(lambda x: lax.fori_loop(
        0, steps, lambda i, c: (hcb.id_tap(record, c + i, tap_with_device=True), c)[1], x))
    run(np.arange(4, dtype=np.int32) * 10_000_000).block_until_ready()  # compile, warm up
    hcb.barrier_wait()
    for seen in per_device.values():
        seen.clear()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(np.arange(4, dtype=np.int32) * 10_000_000)
    hcb.barrier_wait()
    rss_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    ok = all(seen == list(range(10_000_000 * d, 10_000_000 * d + steps))
             for d, seen in per_device.items())
    peak = max(s["peak_bytes_queued"] for s in hcb.queue_stats().values())
    waits = sum(s["waits"] for s in hcb.queue_stats().values())
    print(ok, sum(map(len, per_device.values())), peak, waits, round(rss_growth_mib, 1))
    """


def test_a_million_taps_on_four_devices_arrive_once_in_order_within_the_budget():
    result = run_python(VOLUME, devices=4, timeout=600)
    assert result.returncode == 0, result.stderr
    ok, count, peak, waits, rss_growth_mib = result.stdout.split()
    assert ok == "True" and int(count) == 1_000_000
    assert int(peak) <= 1 << 20  # never more than the budget queued per device
    assert int(waits) > 0  # the devices outran the receivers and waited, nothing was dropped
    # 4 queues of 1 MiB, plus receiver batches and Python objects: far below the 128 MB of data
    assert float(rss_growth_mib) < 64, rss_growth_mib
