"""The README's demo runs and reports every step."""

import subprocess
import sys

from hostcallback.consumer import read_records


def test_demo_prints_every_step_and_writes_a_stream_and_a_plot(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hostcallback", "demo", "--steps", "20",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=240,
                            check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines[:20]] == [str(i) for i in range(20)]
    assert "20 steps computed" in lines[20] and "20 steps reported" in lines[20]
    assert [r.step for r in read_records(tmp_path / "train.hcbs")] == list(range(20))
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
