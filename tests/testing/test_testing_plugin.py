"""The pytest plugin: tap_records collects by name, and a test whose consumer raised fails, with
or without the fixture, instead of the test after it."""

import subprocess
import textwrap

import jax
import jax.numpy as jnp
import pytest

import hostcallback as hcb
from helpers import run_pytest

TWO_TESTS_WITHOUT_THE_FIXTURE = """
    import jax
    import hostcallback as hcb

    def broken(arg, transforms):
        raise ValueError(f"consumer broke on {arg}")

    def test_a_broken_consumer():
        jax.jit(lambda x: hcb.id_tap(broken, x))(7.0)

    def test_the_next_one():
        jax.jit(lambda x: x + 1)(1.0)
    """


def run_sample(tmp_path, test_source: str, ini: str = "") -> subprocess.CompletedProcess:
    """Runs pytest -rA on one test file (and an ini file if given) in a fresh process."""
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(test_source))
    if ini:
        (tmp_path / "pytest.ini").write_text(textwrap.dedent(ini))
    return run_pytest(tmp_path, "-rA", "test_sample.py")


def test_tap_records_files_values_by_name(tap_records):
    jax.jit(lambda x: (hcb.id_tap(tap_records.tap("loss"), x),
                       hcb.id_tap(tap_records.tap("lr"), x / 10)))(jnp.float32(5))
    hcb.barrier_wait()
    assert tap_records.names() == ["loss", "lr"]
    assert tap_records["loss"] == [5.0] and tap_records["lr"] == [0.5]


def test_a_consumer_error_fails_the_test_that_used_the_fixture(tmp_path):
    test_file = tmp_path / "test_failing_consumer.py"
    test_file.write_text(textwrap.dedent("""
        import jax
        import hostcallback as hcb

        def broken(arg, transforms):
            raise ValueError("consumer broke")

        def test_uses_a_broken_consumer(tap_records):
            jax.jit(lambda x: hcb.id_tap(broken, x))(1.0)
        """))
    result = run_pytest(tmp_path, "-q", str(test_file))
    assert result.returncode == 1, result.stdout
    assert "a tap consumer raised during the test" in result.stdout
    assert "consumer broke" in result.stdout


JAX_SIGNATURES_ONLY = """
    import jax
    import hostcallback as hcb

    def broken(x):
        raise ValueError(f"callback broke on {x}")

    def test_a_broken_consumer():
        jax.jit(lambda x: hcb.{function})(7.0)

    def test_the_next_one():
        jax.jit(lambda x: x + 1)(1.0)
    """


def test_a_session_that_uses_only_the_functions_with_jax_signatures_is_waited_for(tmp_path):
    """hostcallback.debug imports neither api.py nor anything of id_tap's; the plugin's wait after
    the test is what reports its callback's error (a failing io_callback or pure_callback fails
    its computation by itself)."""
    result = run_sample(tmp_path, JAX_SIGNATURES_ONLY.replace("{function}",
                                                              "debug.callback(broken, x)"))
    assert "FAILED test_sample.py::test_a_broken_consumer" in result.stdout, result.stdout
    assert "PASSED test_sample.py::test_the_next_one" in result.stdout, result.stdout
    assert "a tap consumer raised during the test" in result.stdout
    assert "callback broke on 7.0" in result.stdout


def test_a_consumer_error_fails_its_own_test_without_the_fixture(tmp_path):
    result = run_sample(tmp_path, TWO_TESTS_WITHOUT_THE_FIXTURE)
    assert result.returncode == 1, result.stdout
    assert "FAILED test_sample.py::test_a_broken_consumer" in result.stdout, result.stdout
    assert "PASSED test_sample.py::test_the_next_one" in result.stdout, result.stdout
    assert "consumer broke on 7.0" in result.stdout


def test_the_wait_after_each_test_can_be_turned_off(tmp_path):
    result = run_sample(tmp_path, TWO_TESTS_WITHOUT_THE_FIXTURE + """
    def test_the_error_is_still_there_for_an_explicit_barrier():
        import pytest
        with pytest.raises(hcb.CallbackException, match="consumer broke"):
            hcb.barrier_wait()
    """, ini="""
    [pytest]
    hostcallback_wait_after_each_test = false
    """)
    assert result.returncode == 0, result.stdout
    assert "3 passed" in result.stdout


def test_a_consumer_error_is_added_to_a_test_that_failed_on_its_own(tmp_path):
    result = run_sample(tmp_path, """
    import jax
    import hostcallback as hcb

    def broken(arg, transforms):
        raise ValueError("consumer broke too")

    def test_fails_twice():
        jax.jit(lambda x: hcb.id_tap(broken, x))(1.0)
        assert False, "the test's own failure"

    def test_the_next_one():
        jax.jit(lambda x: x + 1)(1.0)
    """)
    assert "FAILED test_sample.py::test_fails_twice" in result.stdout, result.stdout
    assert "the test's own failure" in result.stdout
    assert "a tap consumer raised during the test: " in result.stdout  # the note, not the log
    assert "PASSED test_sample.py::test_the_next_one" in result.stdout, result.stdout


def test_a_session_that_never_uses_hostcallback_never_imports_jax(tmp_path):
    result = run_sample(tmp_path, """
    import sys

    def test_plain():
        assert 1 + 1 == 2

    def test_still_no_jax(request):
        assert request.config.pluginmanager.has_plugin("hostcallback")
        assert "jax" not in sys.modules
    """)
    assert result.returncode == 0, result.stdout
    assert "2 passed" in result.stdout


def test_a_name_never_handed_out_is_a_key_error_naming_the_known_ones(tap_records):
    tap_records.tap("loss")
    assert tap_records["loss"] == []  # handed out, nothing tapped yet
    with pytest.raises(KeyError, match="'typo'.*known names: 'loss'"):
        tap_records["typo"]


def test_a_consumer_that_hangs_fails_its_test_once_and_the_session_goes_on(tmp_path):
    result = run_sample(tmp_path, """
    import threading
    import jax
    import hostcallback as hcb

    release = threading.Event()

    def stuck(arg, transforms):
        release.wait(30)

    def test_a_stuck_consumer():
        jax.jit(lambda x: hcb.id_tap(stuck, x))(1.0)

    def test_the_next_one_does_not_wait_again():
        jax.jit(lambda x: x + 1)(1.0)
        release.set()
    """, ini="""
    [pytest]
    hostcallback_wait_timeout = 1
    """)
    assert "FAILED test_sample.py::test_a_stuck_consumer" in result.stdout, result.stdout
    assert "not all handled within 1 s" in result.stdout
    assert "no longer waits after tests in this session" in result.stdout
    assert "PASSED test_sample.py::test_the_next_one_does_not_wait_again" in result.stdout
