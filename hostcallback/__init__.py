"""hostcallback: see values from inside jitted JAX code on the host, without Python on the
device thread.

The public API, and nothing else. The "Architecture" document says how a tap travels.

Importing this package must not import jax: pytest loads ``hostcallback.testing`` in every run
of an environment that has hostcallback installed, and that runs this file. The names that need
jax or the compiled core (the API, the receiver's, a record's context) are imported on first
use, by ``__getattr__`` below, and a JAX older than the oldest supported is refused then
(hostcallback._jax), not at plugin load.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from hostcallback import config
from hostcallback.config import configure
from hostcallback.errors import CallbackException, ReceiverStoppedError
from hostcallback.flavors import CallbackFlavor

if TYPE_CHECKING:
    from hostcallback._host.receiver import reset_peak_bytes_queued
    from hostcallback._host.record_context import RecordContext, current_record
    from hostcallback.api import (
        barrier_wait,
        call,
        id_print,
        id_tap,
        queue_stats,
        stop_outfeed_receiver,
        taps_delivered,
    )
    from hostcallback.jax_callbacks import io_callback, pure_callback
    from hostcallback.serving import serve_jax_callbacks, serving_jax_callbacks

__version__ = "0.1.0"

# hostcallback.consumer is the repository's consumer/ folder, installed inside this package. When
# this file is a source checkout's (its folder has no consumer/, its parent holds pyproject.toml
# and consumer/), the consumers are found beside it.
_here = os.path.dirname(os.path.abspath(__file__))
_checkout = os.path.dirname(_here)
if (not os.path.isdir(os.path.join(_here, "consumer"))
        and os.path.isfile(os.path.join(_checkout, "pyproject.toml"))
        and os.path.isfile(os.path.join(_checkout, "consumer", "__init__.py"))
        and _checkout not in __path__):
    __path__.append(_checkout)


__all__ = [
    "CallbackException",
    "CallbackFlavor",
    "ReceiverStoppedError",
    "RecordContext",
    "barrier_wait",
    "call",
    "config",
    "configure",
    "current_record",
    "debug",
    "id_print",
    "id_tap",
    "io_callback",
    "pure_callback",
    "queue_stats",
    "reset_peak_bytes_queued",
    "serve_jax_callbacks",
    "serving_jax_callbacks",
    "stop_outfeed_receiver",
    "taps_delivered",
]

# The public names that need jax or the compiled core, by the module that defines them.
_IMPORTED_ON_FIRST_USE = {
    **dict.fromkeys(("barrier_wait", "call", "id_print", "id_tap", "queue_stats",
                     "stop_outfeed_receiver", "taps_delivered"), "hostcallback.api"),
    **dict.fromkeys(("io_callback", "pure_callback"), "hostcallback.jax_callbacks"),
    **dict.fromkeys(("serve_jax_callbacks", "serving_jax_callbacks"), "hostcallback.serving"),
    **dict.fromkeys(("RecordContext", "current_record"), "hostcallback._host.record_context"),
    "reset_peak_bytes_queued": "hostcallback._host.receiver",
}


# Public submodules that need jax: ``hcb.debug.print`` works without importing them first.
_SUBMODULES = ("debug",)
_IMPORTED_ON_FIRST_USE.update(dict.fromkeys(_SUBMODULES, ""))


def __getattr__(name: str) -> Any:
    module = _IMPORTED_ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'hostcallback' has no attribute {name!r}")
    if name in _SUBMODULES:
        value = importlib.import_module(f"hostcallback.{name}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_IMPORTED_ON_FIRST_USE))
