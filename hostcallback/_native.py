"""Loads the compiled outfeed extension and says clearly what to do when it is missing."""

from __future__ import annotations

try:
    import _hostcallback_outfeed as outfeed
except ImportError as error:  # pragma: no cover - only on a broken install
    raise ImportError(
        "hostcallback's native extension (_hostcallback_outfeed) is not built or not importable: "
        "install the package with `pip install .` (or `pip install -e .`) from its source tree"
    ) from error

__all__ = ["outfeed"]
