"""The pytest plugin costs nothing to a project that does not use it, and works for one that does.

Installing hostcallback registers ``hostcallback.testing`` with every pytest run in that
environment, so loading it must not import jax. Each test runs a fresh ``python -m pytest`` on a
tiny project in tmp_path, with the plugin loaded the way a user's run loads it: from the
installed entry point.
"""

import json
import textwrap

from helpers import run_pytest

# The modules that would mean the plugin made an unrelated run pay for JAX.
HEAVY_MODULES = ("jax", "jaxlib", "hostcallback._jax", "hostcallback.api",
                 "hostcallback.jax_callbacks",
                 "hostcallback._host.receiver", "hostcallback.lifecycle",
                 "hostcallback._native")


def test_an_unrelated_pytest_run_imports_no_jax(tmp_path):
    (tmp_path / "test_unrelated.py").write_text(textwrap.dedent(f"""
        import json
        import sys

        def test_records_what_the_session_imported(request):
            assert request.config.pluginmanager.has_plugin("hostcallback")
            heavy = sorted(name for name in sys.modules
                           if any(name == prefix or name.startswith(prefix + ".")
                                  for prefix in {HEAVY_MODULES!r}))
            with open("imported.json", "w") as file:
                json.dump(heavy, file)
        """))
    result = run_pytest(tmp_path, "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    heavy = json.loads((tmp_path / "imported.json").read_text())
    assert not heavy, f"an unrelated pytest run imported {len(heavy)} heavy modules: {heavy[:8]}"


def test_tap_records_collects_a_tap_from_a_jitted_function(tmp_path):
    # The test module imports hostcallback only inside the test, after the fixture's set-up, so
    # the fixture's own import is the one that makes hostcallback usable.
    (tmp_path / "test_uses_the_fixture.py").write_text(textwrap.dedent("""
        import jax
        import jax.numpy as jnp

        from hostcallback.testing import TapRecords

        def test_the_tapped_value_arrives(tap_records):
            import hostcallback as hcb

            assert isinstance(tap_records, TapRecords)
            jax.jit(lambda x: hcb.id_tap(tap_records.tap("doubled"), x * 2))(jnp.float32(21))
            hcb.barrier_wait()
            assert tap_records["doubled"] == [42.0]
        """))
    result = run_pytest(tmp_path, "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
