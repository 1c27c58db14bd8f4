"""The README's demo runs and reports every step."""

import subprocess
import sys


def test_demo_prints_every_step_and_a_summary():
    result = subprocess.run([sys.executable, "-m", "hostcallback", "demo", "--steps", "20"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines[:20]] == [str(i) for i in range(20)]
    assert "20 steps computed" in lines[-1] and "20 steps reported" in lines[-1]
