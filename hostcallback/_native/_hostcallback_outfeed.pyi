"""Types of the compiled core (module.cc binds each name; hostcallback._native imports it as
``outfeed``). The docstrings live in the extension: ``help(outfeed.drain)``."""

import sys
from collections.abc import Sequence
from typing import Any, Final, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

if sys.version_info >= (3, 13):
    from types import CapsuleType
else:
    from typing_extensions import CapsuleType

# The bytes of one leaf or one result: a 1-D, C-contiguous uint8 array (read-only is fine).
_Bytes: TypeAlias = npt.NDArray[np.uint8]
# (dtype code, dims, bytes): one array as enqueue() and call() take it (wire.as_leaf).
_Leaf: TypeAlias = tuple[int, Sequence[int], _Bytes]
# (consumer_id, device, sequence, flags, arrays): one decoded record. arrays are read-only
# zero-copy views of the record, or, for a record that could not be decoded, why (a str).
_DrainedRecord: TypeAlias = tuple[int, int, int, int, tuple[npt.NDArray[Any], ...] | str]

class _PinnedStats(TypedDict):
    pinned_bytes: int
    in_use_bytes: int
    hits: int
    misses: int
    pageable_fallbacks: int

class _QueueStats(TypedDict):
    records_enqueued: int
    bytes_enqueued: int
    records_delivered: int
    barrier_markers_enqueued: int
    barrier_markers_delivered: int
    bytes_delivered: int
    bytes_queued: int
    peak_bytes_queued: int
    bytes_reserved: int
    waits: int
    wait_seconds: float
    producers_waiting: int
    batches: int
    receiver_wakeups: int
    receivers_waiting: int
    fences_waiting: int
    fence_waits: int
    fence_wait_seconds: float
    fences_released: int
    calls_waiting: int
    answers_unclaimed: int

class _Computations(TypedDict):
    begun: int
    oldest_running: int
    running: int
    seconds_since_end: float

class _PoolStats(TypedDict):
    pooled_bytes: int
    in_use_bytes: int
    hits: int
    misses: int
    records_held: int

# ---- constants (constants.h and timeouts.h) ----------------------------------------------------

NATIVE_PLATFORM: Final = "cpu"
WIRE_DTYPES: Final[dict[int, str]]  # numpy's (and ml_dtypes') name of each wire dtype code
FFI_API_VERSION: Final[tuple[int, int]]  # of the XLA FFI headers the core was built against
ALL_DEVICES: Final = -1
WIRE_VERSION: Final = 1
WIRE_MAGIC: Final = 0x31424348
WIRE_ALIGNMENT: Final = 64
WIRE_FIXED_HEADER_BYTES: Final = 48
WIRE_DESCRIPTOR_BYTES: Final = 16
WIRE_MAX_NDIM: Final = 64
FLAG_EXPECTS_RESPONSE: Final = 1
FLAG_HANDED_OVER_IN_PYTHON: Final = 2
BARRIER_MARKER_ID: Final = 0
RECORD_CONSUMER_ID: Final = 0
RECORD_DEVICE_ID: Final = 1
RECORD_SEQUENCE: Final = 2
RECORD_FLAGS: Final = 3
RECORD_LEAVES: Final = 4
CALL_TIMEOUT_PREFIX: Final[str]
CALL_FAILED_ELSEWHERE: Final[str]

# ---- the FFI handlers, for jax.ffi.register_ffi_target -----------------------------------------

def registrations() -> dict[str, CapsuleType]: ...
def mark_receiver_thread() -> None: ...
def close_exit_gate(timeout_s: float) -> bool: ...
def exit_gate() -> CapsuleType: ...
def cuda_registrations() -> dict[str, CapsuleType]: ...
def set_cuda_device_ids(ids: Sequence[int]) -> None: ...
def pinned_stats() -> _PinnedStats: ...

# ---- the queues --------------------------------------------------------------------------------

def drain(
    device: int,
    max_records: int,
    max_bytes: int,
    timeout_s: float,
    platform: str = "cpu",
    coalesce_s: float = 0.0,
    linger_s: float = 0.0,
) -> tuple[list[_DrainedRecord], list[int]]: ...
def drain_raw(
    device: int, max_records: int, max_bytes: int, timeout_s: float, platform: str = "cpu"
) -> list[npt.NDArray[np.uint8]]: ...
def enqueue(
    device: int, consumer_id: int, leaves: Sequence[_Leaf], platform: str = "cpu"
) -> None: ...
def reserve(device: int, bytes: int, platform: str = "cpu") -> None: ...
def commit(
    device: int, consumer_id: int, leaves: Sequence[_Leaf], reserved: int, platform: str = "cpu"
) -> int: ...
def cancel_reservation(device: int, bytes: int, platform: str = "cpu") -> None: ...
def enqueue_handed_over(
    device: int,
    consumer_id: int,
    leaves: Sequence[_Leaf],
    held_bytes: int,
    platform: str = "cpu",
) -> None: ...
def call_host(
    device: int,
    consumer_id: int,
    leaves: Sequence[_Leaf],
    timeout_s: float,
    platform: str = "cpu",
) -> list[npt.NDArray[np.uint8]]: ...
def call_host_handed_over(
    device: int,
    consumer_id: int,
    leaves: Sequence[_Leaf],
    timeout_s: float,
    platform: str = "cpu",
) -> None: ...
def keep_call_failure(consumer_id: int, reason: str) -> int: ...
def call_failure_reason(consumer_id: int, failure_id: int) -> str: ...
def respond(
    device: int, sequence: int, results: Sequence[_Bytes], platform: str = "cpu"
) -> bool: ...
def respond_error(device: int, sequence: int, message: str, platform: str = "cpu") -> None: ...
def stats(device: int, platform: str = "cpu") -> _QueueStats: ...
def reset_peak_bytes_queued(device: int, platform: str = "cpu") -> None: ...
def set_closed(closed: bool) -> None: ...
def fail(device: int, reason: str, platform: str = "cpu") -> None: ...

# ---- delivery: what the receivers have handled, and the tapped computations running ----------

def await_handled(device: int, timeout_s: float, platform: str = "cpu") -> str: ...
def await_taps(device: int, platform: str = "cpu") -> str: ...
def call_waiting(device: int, sequence: int, platform: str = "cpu") -> bool: ...
def computations(device: int, platform: str = "cpu") -> _Computations: ...
def computation_failed() -> None: ...
def shared_calls_kept() -> int: ...
def abandon_computations(device: int, before_id: int, platform: str = "cpu") -> int: ...
def fail_tap_computation(device: int, sequence: int, why: str, platform: str = "cpu") -> None: ...
def set_exiting() -> None: ...
def dropped_at_exit() -> int: ...
def set_leaving() -> None: ...
def interrupt_calls() -> None: ...
def watch_interrupts() -> None: ...
def seconds_since_interrupt() -> float: ...
def set_max_queue_bytes(max_queue_bytes: int) -> None: ...
def max_queue_bytes() -> int: ...

# ---- the buffer pool ---------------------------------------------------------------------------

def pooled_bytes() -> int: ...
def pool_stats() -> _PoolStats: ...
