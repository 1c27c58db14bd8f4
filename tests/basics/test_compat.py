"""The JAX seam: the supported range, the warning on an untested JAX, the portable mode, and
that nothing outside the seam reaches into JAX's internals."""

import re

import jax
import pytest

from helpers import ROOT, run_python
from hostcallback import versions
from hostcallback._native import ffi_api, outfeed

PACKAGE = ROOT / "hostcallback"


def test_version_text_is_read_as_numbers():
    assert versions.version_tuple("0.12.0.1") == (0, 12, 0, 1)
    assert versions.version_tuple("0.13.0.dev20261101") == (0, 13, 0)
    assert versions.version_tuple("0.9.2rc1") == (0, 9, 2)


def test_only_the_seam_imports_jax_internals():
    offenders = [str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                 if "_jax" not in path.parts
                 and re.search(r"\bjax\._src\b", path.read_text())]
    offenders += [str(path) for path in (PACKAGE.parent / "consumer").rglob("*.py")
                  if re.search(r"\bjax\._src\b", path.read_text())]
    assert offenders == []


def test_a_jax_imported_older_than_supported_is_refused_at_first_use_of_the_api():
    result = run_python("""
        import jax
        jax.__version__ = "0.7.2"
        import hostcallback
        hostcallback.id_tap
        """)
    assert result.returncode != 0
    assert "ImportError: hostcallback supports jax 0.8 to 0.12" in result.stderr
    assert "this is jax 0.7.2" in result.stderr


def test_a_jax_newer_than_tested_imports_and_warns_once():
    result = run_python("""
        import warnings
        warnings.simplefilter("always")
        import jax
        jax.__version__ = "0.13.0"
        with warnings.catch_warnings(record=True) as caught:
            import hostcallback as hcb
            hcb.id_tap
        print(sum("has been tested with" in str(w.message) for w in caught))
        got = []
        jax.jit(lambda x: hcb.id_tap(lambda a, t: got.append(int(a)), x))(7)
        hcb.barrier_wait()
        print(got)
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["1", "[7]"]


PORTABLE_PROGRAM = """
    import sys, warnings
    warnings.simplefilter("always")
    {before}
    with warnings.catch_warnings(record=True) as caught:
        import hostcallback as hcb
        hcb.id_tap  # the API's first use imports JAX and the seam
    import jax, jax.numpy as jnp
    got = []
    def keep(a, transforms):
        got.append(a.tolist())
    step = jax.jit(lambda x: hcb.id_tap(keep, x * 2) + 1)
    print(step(jnp.arange(3)).tolist())
    print(jax.jit(lambda x: hcb.call(lambda a: a + 10, x, result_shape=x))(jnp.int32(1)))
    hcb.barrier_wait()
    print(got)
    from hostcallback import _jax, versions
    print(_jax.PORTABLE)
    print(sum("portable mode" in str(w.message) for w in caught))
    print(sorted(m for m in sys.modules if m.startswith("hostcallback.")
                 and m.split(".")[1] in ("primitive", "program_order", "keep_taps",
                                         "sharded_lowering")))
    """


@pytest.mark.parametrize("transport", ["native", "callback"])
def test_the_portable_mode_can_be_forced_and_taps_and_calls_work(transport):
    result = run_python(PORTABLE_PROGRAM.format(before=""),
                        env={"HOSTCALLBACK_PORTABLE": "1", "HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:6] == ["[1, 3, 5]", "11", "[[0, 2, 4]]", "True", "0", "[]"]


def test_a_jax_without_a_private_piece_falls_back_to_the_portable_mode_and_says_so_once():
    result = run_python(PORTABLE_PROGRAM.format(
        before="sys.modules['hostcallback._jax.private'] = None  # as if it failed to import"),
        env={"HOSTCALLBACK_PORTABLE": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:6] == ["[1, 3, 5]", "11", "[[0, 2, 4]]", "True", "1", "[]"]


def test_the_portable_mode_refuses_what_it_lacks_and_says_why():
    result = run_python("""
        import jax
        import hostcallback as hcb
        try:
            jax.jit(lambda x: hcb.id_tap(print, x, ordered=True))(1)
        except NotImplementedError as error:
            print(error)
        """, env={"HOSTCALLBACK_PORTABLE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ordered=True (HOSTCALLBACK_ORDERED=1) needs JAX internals "
                                    "that hostcallback's portable mode does not use")


def test_a_misspelt_portable_setting_is_refused_clearly():
    result = run_python("import hostcallback; hostcallback.id_tap",
                        env={"HOSTCALLBACK_PORTABLE": "maybe"})
    assert result.returncode != 0
    assert "HOSTCALLBACK_PORTABLE='maybe': use 1/true/yes/on or 0/false/no/off" in result.stderr


def test_the_core_was_built_for_an_ffi_api_this_jaxlib_accepts():
    assert ffi_api.jaxlib_version() is not None
    assert ffi_api.accepts(tuple(outfeed.FFI_API_VERSION), ffi_api.jaxlib_version())
    assert ffi_api.MISMATCH is None


def test_jaxlib_accepts_its_own_minor_ffi_version_and_older_ones_never_newer():
    assert ffi_api.accepts((0, 2), (0, 3))
    assert ffi_api.accepts((0, 3), (0, 3))
    assert not ffi_api.accepts((0, 4), (0, 3))
    assert not ffi_api.accepts((0, 1), (1, 1))


# The first tap and call where jaxlib would refuse the core's handlers: the portable mode on
# JAX's own callbacks, a warning that says to rebuild, and JAX's CPU backend still up.
REFUSED_CORE_PROGRAM = """
    import os, sys, tempfile, warnings
    warnings.simplefilter("always")
    import jax, jax.numpy as jnp
    {before}
    with warnings.catch_warnings(record=True) as caught:
        import hostcallback as hcb
        hcb.id_tap
    got = []
    print(jax.jit(lambda x: hcb.id_tap(lambda a, t: got.append(a.tolist()), x * 2) + 1)(
        jnp.arange(3)).tolist())
    print(jax.jit(lambda x: hcb.call(lambda a: a + 10, x, result_shape=x))(jnp.int32(1)))
    hcb.barrier_wait()
    print(got, jax.devices()[0].platform, jnp.ones(2).sum())
    from hostcallback import _jax
    print(_jax.PORTABLE)
    print(" | ".join(str(w.message) for w in caught if "portable mode" in str(w.message)))
    """

AS_IF_JAXLIB_SPOKE_AN_OLDER_FFI_API = """
    headers = tempfile.mkdtemp()
    os.makedirs(os.path.join(headers, "xla", "ffi", "api"))
    with open(os.path.join(headers, "xla", "ffi", "api", "c_api.h"), "w") as file:
        file.write("#define XLA_FFI_API_MAJOR 0\\n#define XLA_FFI_API_MINOR 0\\n")
    jax.ffi.include_dir = lambda: headers  # what jaxlib says of its own FFI API version
    """


def _check_the_refused_core_falls_back(result, jaxlib_ffi_api: str):
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[:4] == ["[1, 3, 5]", "11", "[[0, 2, 4]] cpu 2.0", "True"]
    core = "{}.{}".format(*outfeed.FFI_API_VERSION)
    assert (f"hostcallback's C++ core was built against XLA FFI API {core}, and this jaxlib "
            f"({jax.__version__}) speaks {jaxlib_ffi_api}: it would refuse") in lines[4]
    assert "pip install --force-reinstall --no-deps --no-build-isolation ." in lines[4]
    assert lines[4].count("portable mode") == 1


def test_a_jaxlib_that_would_refuse_the_core_gets_the_portable_mode_and_says_to_rebuild():
    result = run_python(REFUSED_CORE_PROGRAM.format(
        before=AS_IF_JAXLIB_SPOKE_AN_OLDER_FFI_API.strip()),
        env={"HOSTCALLBACK_PORTABLE": "0"})
    _check_the_refused_core_falls_back(result, "0.0")


@pytest.mark.skipif(ffi_api.MISMATCH is None,
                    reason="needs a core built against a newer jaxlib's FFI headers (.ci/compat)")
def test_a_core_built_for_a_newer_jaxlib_falls_back_to_the_portable_mode():
    result = run_python(REFUSED_CORE_PROGRAM.format(before=""),
                        env={"HOSTCALLBACK_PORTABLE": "0"})
    _check_the_refused_core_falls_back(result, "{}.{}".format(*ffi_api.jaxlib_version()))
