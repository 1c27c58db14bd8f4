"""examples/train.py trains briefly and leaves a stream, TensorBoard events, progress and a plot."""

import subprocess
import sys
from pathlib import Path

import pytest

from consumer import read_records
from consumer.tensorboard import event_files, read_events, read_scalars

pytest.importorskip("optax", reason="the example needs the examples extra")

EXAMPLE = Path(__file__).parent.parent / "examples" / "train.py"


@pytest.mark.timeout(300)
def test_the_training_example_feeds_every_sink(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "40", "--eval-every", "10",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=280,
                            check=False)
    assert result.returncode == 0, result.stderr
    records = list(read_records(tmp_path / "train.hcbs"))
    assert [r.step for r in records if r.name == "train"] == list(range(40))
    assert [r.step for r in records if r.name == "eval"] == [0, 10, 20, 30]
    losses = [float(r.value["loss"]) for r in records if r.name == "train"]
    assert sum(losses[-10:]) < sum(losses[:10])  # it learns
    scalars = read_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["train/loss"]] == list(range(40))
    assert {"train/grad_norm", "train/layer_grad_norm/layer1", "eval/loss"} <= set(scalars)
    histograms = [v.tag for path in event_files(tmp_path / "tb") for event in read_events(path)
                  for v in event.summary.value if v.HasField("histo")]
    assert histograms == ["train/grads/layer1_w"] * 40
    progress = result.stderr.splitlines()
    assert progress[-1].startswith("train: 40/40 steps (100%)") and progress[-1].endswith("done")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
