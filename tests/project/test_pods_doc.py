"""docs/pods.md's sharded training step runs as written, on both transports."""

import re

import pytest

from helpers import ROOT, run_python

GUIDE = ROOT / "docs" / "pods.md"
(EXAMPLE,) = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.mark.parametrize("transport", ["native", "callback"])
@pytest.mark.needs_internals("taps in a jit over a sharded mesh and partitioned=True")
def test_the_pods_example_runs_and_taps_as_it_says(transport):
    result = run_python(EXAMPLE, env={"HOSTCALLBACK_TRANSPORT": transport})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("losses: [")
