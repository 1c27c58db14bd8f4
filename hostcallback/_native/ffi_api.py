"""Whether the running jaxlib accepts the compiled core's XLA FFI handlers, asked before they are
registered: a registration jaxlib refuses makes its CPU backend fail to start, for every user of
JAX in the process, not just for hostcallback.

jaxlib accepts a handler built against the same major FFI API version and a minor one no newer
than its own; it ships the headers of its own version (``jax.ffi.include_dir()``), which say it.
"""

from __future__ import annotations

import os
import re

import jax

from hostcallback._native import outfeed

REBUILD = ("rebuild it against this JAX with `pip install --force-reinstall --no-deps "
           "--no-build-isolation .` from hostcallback's source")


def version_in(header: str) -> tuple[int, int] | None:
    """The FFI API version an XLA ``c_api.h`` declares; None where it is missing or says none."""
    try:
        with open(header, encoding="utf-8") as file:
            text = file.read()
    except OSError:
        return None
    found = dict(re.findall(r"^#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", text, re.MULTILINE))
    if set(found) != {"MAJOR", "MINOR"}:
        return None
    return int(found["MAJOR"]), int(found["MINOR"])


def jaxlib_version() -> tuple[int, int] | None:
    """The running jaxlib's FFI API version, from the headers it ships; None where it has none."""
    return version_in(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h"))


def accepts(core: tuple[int, int], framework: tuple[int, int]) -> bool:
    return core[0] == framework[0] and core[1] <= framework[1]


def mismatch() -> str | None:
    """Why this jaxlib would refuse the core's handlers, or None when it accepts them (or does
    not say which FFI API it speaks, and registration is the only way to know)."""
    framework = jaxlib_version()
    core = tuple(outfeed.FFI_API_VERSION)
    if framework is None or accepts(core, framework):
        return None
    return (f"hostcallback's C++ core was built against XLA FFI API {core[0]}.{core[1]}, and "
            f"this jaxlib ({jax.__version__}) speaks {framework[0]}.{framework[1]}: it would "
            f"refuse the core's handlers (a core built with an older JAX works with newer ones, "
            f"not the other way round); {REBUILD}")


MISMATCH = mismatch()
