"""CPU time of hostcallback's receiver threads, and of every other thread, for the benchmarks
that report it.

Wall time on a shared machine moves with the load; threads' own CPU clocks move much less, so
they show what each side costs even when the wall-time columns are noise.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def receiver_cpu_seconds() -> float:
    """CPU time used so far by the receiver threads (they start with the first tap)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("hostcallback-receiver") and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except OSError:  # the thread ended meanwhile
                pass
    return total


def device_thread_ids() -> list[int] | None:
    """The native ids of every thread of this process but the receivers: the device threads,
    and the callbacks that run on them; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    receivers = {t.native_id for t in threading.enumerate()
                 if t.name.startswith("hostcallback-receiver")}
    return [int(entry) for entry in os.listdir("/proc/self/task") if int(entry) not in receivers]


def device_cpu_seconds() -> float | None:
    """CPU time used so far by the threads of device_thread_ids(); None off Linux. A thread that
    ends between two readings is left out of the second, so keep the threads alive across them
    (XLA's are)."""
    thread_ids = device_thread_ids()
    if thread_ids is None:
        return None
    total = 0.0
    for thread_id in thread_ids:
        try:  # Linux's CPU-time clock of any thread by id, as pthread_getcpuclockid makes it
            total += time.clock_gettime(((~thread_id) << 3) | 6)
        except OSError:
            pass  # that thread has just ended
    return total
