"""JAX's persistent compilation cache: a computation compiled by one process and loaded from the
cache by another taps that process's own tap functions."""

from __future__ import annotations

import pytest

from helpers import run_python

PROGRAM = """
import os, sys
import jax
jax.config.update("jax_compilation_cache_dir", os.environ["CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import hostcallback as hcb

def first(x, transforms): print("first", float(x))
def second(x, transforms): print("second", float(x))

taps = {"first": first, "second": second}
for name in sys.argv[2:]:  # consumers registered before this run's tap, in another computation
    jax.jit(lambda x, f=taps[name]: hcb.id_tap(f, x * 0))(1.0)
print(float(jax.jit(lambda x: hcb.id_tap(taps[sys.argv[1]], x * 2) + 1)(3.0)))
hcb.barrier_wait()
"""


def _run(cache_dir, *args: str) -> list[str]:
    result = run_python(f"import sys; sys.argv = ['program', *{list(args)!r}]\n" + PROGRAM,
                        devices=1, env={"CACHE_DIR": str(cache_dir)})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.needs_internals("native taps, whose computations JAX's persistent cache keeps (it "
                             "keeps none with JAX's callbacks)")
def test_a_computation_loaded_from_the_persistent_cache_taps_this_processes_function(tmp_path):
    assert _run(tmp_path, "first") == ["first 6.0", "7.0"]
    cached = set(tmp_path.iterdir())
    assert cached, "JAX wrote nothing to its cache"
    # The same computation, another function: JAX loads it from the cache (writes nothing new).
    assert _run(tmp_path, "second") == ["second 6.0", "7.0"]
    assert set(tmp_path.iterdir()) == cached
    assert _run(tmp_path, "first", "second") == ["second 0.0", "first 6.0", "7.0"]
