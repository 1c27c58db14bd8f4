"""Loads the consumers' compiled extension, ``hostcallback.consumer._frames`` (the record
stream's frames put together in C++: consumer/_native/frames.cc), as ``frames``.

A source checkout first on sys.path (``python -m pytest`` in the repository) finds this package
in its ``consumer/`` folder, which holds no build: the installed package's copy of the folder,
which does, is searched too. Where it cannot be loaded, ``frames`` is None and ``missing`` says
why: the sinks then frame every record in Python (slower, the same bytes), and say so once.
"""

from __future__ import annotations

import sys

from hostcallback.addons import add_installed_copies, exit_gate

_package = sys.modules[__name__.rpartition(".")[0]]  # hostcallback.consumer, being imported
missing: str | None = None

try:
    from hostcallback.consumer import _frames as frames
except ImportError:
    add_installed_copies(_package.__path__, "hostcallback", "consumer")
    try:
        from hostcallback.consumer import _frames as frames
    except ImportError as error:  # only on a broken install
        frames = None
        missing = (f"hostcallback's consumer extension (hostcallback.consumer._frames) cannot be "
                   f"loaded ({error}): sinks frame every record in Python; reinstall with `pip "
                   f"install .` from hostcallback's source tree")

if frames is not None:  # a receiver framing records at exit parks as it does in the core
    frames.share_exit_gate(exit_gate())

__all__ = ["frames", "missing"]
