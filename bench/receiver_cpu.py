"""CPU time of hostcallback's receiver threads, for the benchmarks that report it.

Wall time on a shared machine moves with the load; the receivers' own CPU clocks hardly do, so
they show what the host side costs even when the wall-time columns are noise.
"""

from __future__ import annotations

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
