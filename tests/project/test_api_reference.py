"""The API reference is generated from the docstrings (pdoc, docs/README.md says how): it builds,
it has a page for every public name, and every parameter of a public function is documented."""

import inspect
import subprocess
import sys

import pytest

import hostcallback
import hostcallback.debug

PUBLIC_FUNCTIONS = [
    *((f"hostcallback.{name}", getattr(hostcallback, name)) for name in hostcallback.__all__
      if inspect.isfunction(getattr(hostcallback, name))),
    *((f"hostcallback.debug.{name}", getattr(hostcallback.debug, name))
      for name in hostcallback.debug.__all__
      if inspect.isfunction(getattr(hostcallback.debug, name))),
]


@pytest.mark.parametrize("name, function", PUBLIC_FUNCTIONS, ids=[n for n, _ in PUBLIC_FUNCTIONS])
def test_each_parameter_of_a_public_function_is_documented(name, function):
    doc = inspect.getdoc(function) or ""
    undocumented = [p for p in inspect.signature(function).parameters
                    if p not in ("args", "kwargs") and f"``{p}" not in doc]
    assert undocumented == [], f"{name} does not document {undocumented}"


@pytest.mark.timeout(120)
def test_the_reference_builds_with_a_page_for_every_public_name(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pdoc", "-o", str(tmp_path), "hostcallback",
                             "hostcallback.consumer"], capture_output=True, text=True,
                            timeout=110)
    assert result.returncode == 0, result.stderr
    package = (tmp_path / "hostcallback.html").read_text()
    for name in hostcallback.__all__:
        assert f'id="{name}"' in package or f"hostcallback/{name}.html" in package, name
    debug = (tmp_path / "hostcallback" / "debug.html").read_text()
    for name in hostcallback.debug.__all__:
        assert f'id="{name}"' in debug, name
