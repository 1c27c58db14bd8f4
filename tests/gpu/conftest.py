"""Set-up for the GPU tests: run on a machine with a CUDA GPU as bench/gpu_check.sh runs them,
``pytest --confcutdir=tests/gpu tests/gpu`` (tests/conftest.py, which pins JAX to the CPU, stays
out). In the CPU suite every test here is skipped, saying why.

``HOSTCALLBACK_GPU_TESTS_ON=cpu`` runs them on the CPU instead, to try the tests themselves where
no GPU is at hand: there they run the CPU's handlers, so they show nothing of the GPU's (the
GPU tap, its pinned pool and its fence); what only a GPU shows is skipped."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # helpers.py

PLATFORM = os.environ.get("HOSTCALLBACK_GPU_TESTS_ON", "cuda")
if PLATFORM == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
# The GPU fence is off by default until it has run here (hostcallback/_trace/fence.py).
os.environ.setdefault("HOSTCALLBACK_GPU_FENCE", "1")


def _why_not_here() -> str | None:
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" and PLATFORM != "cpu":
        return ("the suite pins JAX to the CPU (tests/conftest.py); run tests/gpu on a machine "
                "with a CUDA GPU with bench/gpu_check.sh")
    import jax
    try:
        jax.devices(PLATFORM)
    except RuntimeError as error:
        return f"no {PLATFORM} device here ({error})"
    return None


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    why = None
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            why = why or _why_not_here()
            if why:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(params=("native", "callback"))
def transport(request):
    from hostcallback import config
    with config.override(transport=request.param):
        yield request.param


@pytest.fixture
def gpu():
    import jax
    return jax.devices(PLATFORM)[0]
