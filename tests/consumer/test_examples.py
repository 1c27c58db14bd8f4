"""The examples run as documented: train.py trains briefly and leaves a stream, TensorBoard events,
progress and a plot; pod_localhost.py runs a collector with a token and a 2-process JAX job."""

import subprocess
import sys

import pytest

from helpers import ROOT
from hostcallback.consumer import read_records
from hostcallback.consumer.tensorboard import event_files, read_events, read_scalars

EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "train.py"


@pytest.mark.timeout(300)
def test_the_training_example_feeds_every_sink(tmp_path):
    pytest.importorskip("optax", reason="the example needs the examples extra")
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


@pytest.mark.timeout(300)
def test_the_pod_example_gets_every_shard_of_every_process_to_the_collector_once(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLES / "pod_localhost.py"), "--processes",
                             "2", "--steps", "10", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=280, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{tmp_path / 'pod.hcbs'}: 40 records, 40 distinct of 40 expected, 0 duplicates" in (
        result.stdout)
    records = list(read_records(tmp_path / "pod.hcbs"))
    assert {r.source.rsplit("/", 1)[-1] for r in records} == {"p0", "p1"}
    token_file = tmp_path / "token"
    assert token_file.stat().st_mode & 0o077 == 0  # only the user reads the token
    token = token_file.read_text().strip()
    assert len(token) == 64 and token.encode() not in (tmp_path / "pod.hcbs").read_bytes()
    assert token not in result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_the_pod_example_can_write_each_process_to_a_stream_at_a_url(tmp_path):
    pytest.importorskip("fsspec", reason="streams at URLs need fsspec ('.[test]' has it)")
    url = f"file://{tmp_path}/pod/{{process}}.hcbs"
    result = subprocess.run([sys.executable, str(EXAMPLES / "pod_localhost.py"), "--processes",
                             "2", "--steps", "10", "--to", url], capture_output=True,
                            text=True, timeout=280, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": 40 records, 40 distinct of 40 expected, 0 duplicates" in result.stdout
    assert sorted(path.name for path in (tmp_path / "pod").iterdir()) == [
        "0.hcbs.part-000000", "1.hcbs.part-000000"]
