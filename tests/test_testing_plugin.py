"""The pytest plugin: tap_records collects by name and fails a test whose consumer raised."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp

import hostcallback as hcb


def test_tap_records_files_values_by_name(tap_records):
    jax.jit(lambda x: (hcb.id_tap(tap_records.tap("loss"), x),
                       hcb.id_tap(tap_records.tap("lr"), x / 10)))(jnp.float32(5))
    hcb.barrier_wait()
    assert tap_records.names() == ["loss", "lr"]
    assert tap_records["loss"] == [5.0] and tap_records["lr"] == [0.5]


def test_a_consumer_error_fails_the_test_at_teardown(tmp_path):
    test_file = tmp_path / "test_failing_consumer.py"
    test_file.write_text(textwrap.dedent("""
        import jax
        import hostcallback as hcb

        def broken(arg, transforms):
            raise ValueError("consumer broke")

        def test_uses_a_broken_consumer(tap_records):
            jax.jit(lambda x: hcb.id_tap(broken, x))(1.0)
        """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(test_file)], capture_output=True, text=True, timeout=240,
                            cwd=tmp_path, check=False)
    assert result.returncode == 1, result.stdout
    assert "a tap consumer raised during the test" in result.stdout
    assert "consumer broke" in result.stdout
