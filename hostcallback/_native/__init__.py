"""The compiled core (the C++ sources here, one job a file: ``module.cc`` lists them), built into
this package as ``_hostcallback_outfeed``; what Python sees of it is typed in
``_hostcallback_outfeed.pyi``.

Loads it and says clearly what to do when it is missing; the rest of the code imports
``from hostcallback._native import outfeed`` and never the extension's own name.
"""

from __future__ import annotations

import os
import sys


def add_installed_copies(package_path: list[str], *folder: str) -> None:
    """Adds to ``package_path`` (a package's ``__path__``) each copy of ``folder`` (its parts,
    e.g. "hostcallback", "_native") found under an entry of sys.path: a source checkout first on
    sys.path (``python -m pytest`` in the repository) shadows the installed package, whose copy
    of the folder holds what was built there."""
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), *folder)
        if os.path.isdir(candidate) and candidate not in package_path:
            package_path.append(candidate)


try:
    from hostcallback._native import _hostcallback_outfeed as outfeed
except ImportError:
    add_installed_copies(__path__, "hostcallback", "_native")
    try:
        from hostcallback._native import _hostcallback_outfeed as outfeed
    except ImportError as error:  # pragma: no cover - only on a broken install
        raise ImportError(
            "hostcallback's native extension (hostcallback._native._hostcallback_outfeed) is "
            "not built or not importable: install the package with `pip install .` (or `pip "
            "install -e .`) from its source tree; it needs a C++17 compiler and CMake"
        ) from error

__all__ = ["add_installed_copies", "outfeed"]
