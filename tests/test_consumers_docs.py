"""The python samples of docs/consumers.md's TensorBoard and progress sections run as written."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

DOC = (pathlib.Path(__file__).parent.parent / "docs" / "consumers.md").read_text()
SECTIONS = ("TensorBoard", "Progress bars")


def samples(section: str) -> list[str]:
    body = re.search(rf"^## {section}\n(.*?)(?=^## )", DOC, flags=re.DOTALL | re.MULTILINE)[1]
    return re.findall(r"^```python\n(.*?)^```", body, flags=re.DOTALL | re.MULTILINE)


CASES = [(section, index) for section in SECTIONS for index in range(len(samples(section)))]


def test_each_section_has_samples():
    assert {section for section, _ in CASES} == set(SECTIONS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("section,index", CASES)
def test_consumers_doc_sample_runs(section, index, tmp_path):
    env = dict(os.environ, XLA_FLAGS="")  # one CPU device, as a reader's machine has
    result = subprocess.run([sys.executable, "-c", samples(section)[index]], cwd=tmp_path,
                            capture_output=True, text=True, timeout=280, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
