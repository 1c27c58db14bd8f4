"""Types of the consumers' compiled extension (consumer/_native/frames.cc binds each name;
hostcallback.consumer.native_frames loads it). The docstrings live in the extension."""

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy.typing as npt

# (consumer_id, device, sequence, flags, arrays): one record as the receivers drain it.
_DrainedRecord: TypeAlias = tuple[int, int, int, int, tuple[npt.NDArray[Any], ...] | str]

def frame_records(
    records: list[_DrainedRecord],
    start: int,
    stop: int,
    pieces: Sequence[bytes],
    leaf_dtypes: Sequence[npt.DTypeLike],
    leaf_shapes: Sequence[Sequence[int]],
    step_leaf: int,
    step_kind: str,
    step_size: int,
    now: float = -1.0,
) -> list[bytes]: ...
def crc32(data: bytes) -> int: ...
def share_exit_gate(gate: Any) -> None: ...
