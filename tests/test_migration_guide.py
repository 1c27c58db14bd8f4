"""Every python code sample in docs/migration.md runs as written."""

import pathlib
import re

import pytest
from conftest import run_python

GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "migration.md"
SAMPLES = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.DOTALL | re.MULTILINE)


def test_the_guide_has_samples():
    assert len(SAMPLES) >= 4


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_migration_sample_runs(index):
    result = run_python(SAMPLES[index])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
