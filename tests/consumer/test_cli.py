"""hostcallback-consumer: version, help, tail -n, stats and plot per source, and clean failures."""

import argparse
import os
import subprocess
import sys

import matplotlib
import ml_dtypes
import numpy as np
import pytest

from hostcallback.consumer import TapRecord, stream
from hostcallback.consumer.__main__ import build_parser
from hostcallback.consumer.plotting import draw
from hostcallback.consumer.series import read_series, select, smooth

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "hostcallback.consumer", *args],
                          capture_output=True, text=True, timeout=120, check=False, **kwargs)


def record(step, device_id, loss, name="train", **extra):
    return TapRecord(name=name, step=step, device_id=device_id, device=f"TFRT_CPU_{device_id}",
                     value={"step": np.int32(step), "loss": np.float32(loss), **extra})


@pytest.fixture
def two_devices(tmp_path):
    """Ten steps from each of two devices; device 1's loss is twice device 0's."""
    path = tmp_path / "pod.hcbs"
    records = [record(s, d, (d + 1) / (s + 1), grad_norm=np.float32(s))
               for s in range(10) for d in (0, 1)]
    path.write_bytes(stream.dumps(records))
    return path


def test_version_names_the_package_and_its_version():
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == "hostcallback 0.1.0"


def test_every_option_of_every_subcommand_has_help_text():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(subparsers.choices) == ["collect", "plot", "stats", "tail"]
    for name, subparser in subparsers.choices.items():
        for action in subparser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_tail_n_prints_only_the_last_records(two_devices):
    result = cli("tail", "-n", "2", str(two_devices))
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if "name: train" in line]
    assert headers == ["device: TFRT_CPU_0 name: train step: 9",
                       "device: TFRT_CPU_1 name: train step: 9"]


def _tail_follow(path, last: int, lines: int, then=None, then_lines: int = 0):
    """Runs ``tail -n LAST -f PATH``: reads ``lines`` lines, calls ``then()``, reads
    ``then_lines`` more; returns both lists."""
    follower = subprocess.Popen([sys.executable, "-m", "hostcallback.consumer", "tail", "-n",
                                 str(last), "-f", str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    try:
        first = [follower.stdout.readline().strip() for _ in range(lines)]
        if then is not None:
            then()
        after = [follower.stdout.readline().strip() for _ in range(then_lines)]
    finally:
        follower.terminate()
        follower.wait(10)
    return first, after


def _emit_step(sink, step: int) -> None:
    sink.emit(TapRecord(name="grow", step=step, value=np.int32(step)))
    sink.flush()


@pytest.mark.timeout(60)
def test_tail_n_with_follow_prints_the_last_records_then_new_ones(tmp_path):
    from hostcallback.consumer import FileSink

    sink = FileSink(tmp_path / "grow.hcbs")
    for s in range(5):
        _emit_step(sink, s)
    try:
        first, then = _tail_follow(tmp_path / "grow.hcbs", 1, 2, lambda: _emit_step(sink, 5), 2)
    finally:
        sink.close()
    assert first == ["name: grow step: 4", "4"] and then == ["name: grow step: 5", "5"]


@pytest.mark.timeout(60)
def test_tail_follow_of_a_stream_not_yet_written_waits_for_it(tmp_path):
    from hostcallback.consumer import FileSink

    path = tmp_path / "later.hcbs"
    follower = subprocess.Popen([sys.executable, "-m", "hostcallback.consumer", "tail", "-f",
                                 str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        assert "waiting for" in follower.stderr.readline()
        sink = FileSink(path)
        try:
            _emit_step(sink, 0)
            lines = [follower.stdout.readline().strip() for _ in range(2)]
        finally:
            sink.close()
    finally:
        follower.terminate()
        follower.wait(10)
    assert lines == ["name: grow step: 0", "0"]


def test_tail_follow_in_a_folder_that_is_not_there_is_an_error(tmp_path):
    result = cli("tail", "-f", str(tmp_path / "no-such-folder" / "run.hcbs"))
    assert result.returncode == 1
    assert "No such directory" in result.stderr and "no-such-folder" in result.stderr


def test_stats_reports_per_source_after_the_merged_table(two_devices):
    result = cli("stats", str(two_devices))
    assert result.returncode == 0, result.stderr
    merged, per_source = result.stdout.split("\n\nper source:\n")
    merged_rows = {line.split()[0]: line.split() for line in merged.splitlines()[1:]}
    assert merged_rows["train.loss"][1] == "20"
    header, *lines = per_source.splitlines()
    assert header.split() == ["name", "source", "count", "mean", "min", "max", "last"]
    rows = {tuple(line.split()[:2]): line.split() for line in lines}
    assert rows["train.loss", "p0/dev0"][2:4] == ["10", "0.292897"]
    assert rows["train.loss", "p0/dev1"][2:4] == ["10", "0.585794"]


def test_stats_of_one_source_prints_one_table(two_devices, tmp_path):
    path = tmp_path / "one.hcbs"
    path.write_bytes(stream.dumps([record(s, 0, 1.0) for s in range(3)]))
    result = cli("stats", str(path))
    assert result.returncode == 0 and "per source" not in result.stdout


def test_series_are_read_per_source_and_chosen_by_name_or_glob(two_devices):
    series = read_series([two_devices])
    assert sorted(series) == ["train.grad_norm", "train.loss"]
    assert sorted(series["train.loss"]) == ["p0/dev0", "p0/dev1"]
    assert series["train.loss"]["p0/dev1"].values[:2] == [2.0, 1.0]
    assert select(series, ["train.loss", "train.*"]) == ["train.loss", "train.grad_norm"]
    assert select(series, ["nope*"]) == []


def test_smoothing_is_a_debiased_moving_average():
    np.testing.assert_allclose(smooth([1.0, 1.0, 1.0], 0.9), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(smooth([0.0, 10.0], 0.5), [0.0, 10 * 0.5 / 0.75])
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        smooth([1.0], 1.0)


def test_plot_draws_a_panel_per_series_and_a_line_per_source(two_devices):
    series = read_series([two_devices])
    figure, _ = draw(plt, series, ["train.loss", "train.grad_norm"], logy=True)
    try:
        loss_axes, norm_axes = figure.axes
        assert [line.get_label() for line in loss_axes.get_lines()] == ["p0/dev0", "p0/dev1"]
        assert loss_axes.get_yscale() == "log" and loss_axes.get_ylabel() == "train.loss"
        np.testing.assert_allclose(loss_axes.get_lines()[1].get_ydata()[:2], [2.0, 1.0])
        assert len(norm_axes.get_lines()) == 2
    finally:
        plt.close(figure)


def test_plot_overlays_series_and_smooths_with_the_raw_values_faint(two_devices):
    series = read_series([two_devices])
    figure, _ = draw(plt, series, ["train.loss"], smoothing=0.6, overlay=True)
    try:
        (axes,) = figure.axes
        raw, smoothed = axes.get_lines()[:2]
        assert raw.get_alpha() == 0.25 and smoothed.get_label() == "p0/dev0"
        assert "smoothed 0.6" in axes.get_title()
    finally:
        plt.close(figure)


def test_cli_plot_writes_a_png_of_several_series_from_a_glob(two_devices, tmp_path):
    output = tmp_path / "all.png"
    result = cli("plot", str(two_devices), "--name", "train.*", "--logy", "--smooth", "0.5",
                 "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "values <= 0 cannot be shown on a log scale" in result.stderr  # grad_norm starts at 0


def test_cli_plot_without_a_name_draws_every_series(two_devices, tmp_path):
    output = tmp_path / "every.png"
    result = cli("plot", str(two_devices), "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_smoothing_weight_out_of_range(two_devices, tmp_path):
    result = cli("plot", str(two_devices), "--name", "train.loss", "--smooth", "1.5", "-o",
                 str(tmp_path / "x.png"))
    assert result.returncode == 2 and "is not a number in [0, 1)" in result.stderr


@pytest.mark.parametrize("output", ["loss", "folder/", "."], ids=["no suffix", "folder/", "."])
def test_cli_plot_refuses_an_output_that_is_no_image_file_name(two_devices, tmp_path, output):
    """matplotlib would write ``loss.png`` (or ``folder/.png``) and the command say ``loss``."""
    (tmp_path / "folder").mkdir()
    result = cli("plot", str(two_devices), "-o", output, cwd=tmp_path)
    assert result.returncode == 2 and "is not an image file name" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "pod.hcbs"]
    assert not list((tmp_path / "folder").iterdir())


def test_cli_tail_takes_a_count_beyond_any_stream_as_all(two_devices):
    result = cli("tail", "-n", str(1 << 64), str(two_devices))
    assert result.returncode == 0 and result.stdout.count("name: train") == 20


@pytest.mark.parametrize("command", [["tail"], ["stats"], ["plot", "--name", "x", "-o", "x.png"]])
def test_a_missing_file_is_one_line_on_stderr_and_exit_code_1(command, tmp_path):
    missing = str(tmp_path / "missing.hcbs")
    result = cli(command[0], missing, *command[1:])
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"hostcallback-consumer {command[0]}: No such file or directory: {missing}"]


@pytest.mark.parametrize("command", ["tail", "stats"])
def test_garbage_input_is_one_line_on_stderr_and_exit_code_1(command, tmp_path):
    garbage = tmp_path / "garbage.hcbs"
    garbage.write_bytes(b"this is not a record stream\n" * 10)
    result = cli(command, str(garbage))
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"hostcallback-consumer {command}: {garbage} is not a readable record "
                           "stream: ")


def test_a_directory_instead_of_a_file_is_one_line_on_stderr(tmp_path):
    result = cli("tail", str(tmp_path))
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert "Is a directory" in result.stderr


@pytest.mark.timeout(120)
def test_a_closed_pipe_stops_tail_quietly_with_a_non_zero_exit_code(tmp_path):
    path = tmp_path / "long.hcbs"
    path.write_bytes(stream.dumps([record(s, 0, 1.0) for s in range(20000)]))
    tail = subprocess.Popen([sys.executable, "-m", "hostcallback.consumer", "tail", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tail.stdout.readline()
    tail.stdout.close()  # as `| head -1` does
    stderr = tail.stderr.read().decode()
    assert tail.wait(60) == 141
    assert stderr == ""


def test_an_image_format_matplotlib_cannot_write_is_one_line_naming_the_formats(two_devices,
                                                                                tmp_path):
    result = cli("plot", str(two_devices), "--name", "train.loss", "-o", str(tmp_path / "x.abc"))
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"hostcallback-consumer plot: cannot write {tmp_path / 'x.abc'}")
    assert "png" in line


@pytest.mark.timeout(60)
def test_tail_n_with_follow_counts_the_rotated_files_too(tmp_path):
    from hostcallback.consumer import FileSink

    path = tmp_path / "rotated.hcbs"
    sink = FileSink(path)
    for s in range(4):
        sink.emit(TapRecord(name="grow", step=s, value=np.int32(s)))
    sink.close()
    os.replace(path, f"{path}.1")  # as FileSink rotates
    sink = FileSink(path)
    _emit_step(sink, 4)
    try:
        first, then = _tail_follow(path, 3, 6, lambda: _emit_step(sink, 5), 2)
    finally:
        sink.close()
    assert first[::2] == ["name: grow step: 2", "name: grow step: 3", "name: grow step: 4"]
    assert then == ["name: grow step: 5", "5"]


@pytest.mark.timeout(60)
def test_tail_n_with_follow_past_a_damaged_length_prints_the_last_records(tmp_path):
    data = bytearray(stream.dumps([TapRecord(name="old", step=s, value=s) for s in range(5)]))
    start = -1
    for _ in range(3):  # the header, record 0, record 1
        start = data.find(stream.SYNC, start + 1)
    data[start + 4:start + 8] = (10 ** 6).to_bytes(4, "little")  # record 1's length
    path = tmp_path / "damaged.hcbs"
    path.write_bytes(bytes(data))
    first, _ = _tail_follow(path, 2, 4)
    assert first[::2] == ["name: old step: 3", "name: old step: 4"]


@pytest.mark.parametrize("args,what", [
    (["tail", "-n", "abc", "f.hcbs"], "argument -n/--lines: 'abc' is not a whole number >= 0"),
    (["plot", "f.hcbs", "--name", "x", "-o", "x.png", "--smooth", "much"],
     "argument --smooth: 'much' is not a number in [0, 1)"),
])
def test_a_bad_number_says_which_argument_and_what_it_takes(args, what):
    result = cli(*args)
    assert result.returncode == 2 and what in result.stderr, result.stderr
    assert "_count" not in result.stderr and "_smoothing" not in result.stderr


def test_every_subcommands_messages_share_one_prefix(tmp_path, two_devices):
    missing = str(tmp_path / "missing.hcbs")
    failures = [cli("tail", missing), cli("stats", missing),
                cli("plot", str(two_devices), "--name", "nope", "-o", str(tmp_path / "x.png")),
                cli("collect", "--host", "0.0.0.0", "--port", "0", "--out", str(tmp_path))]
    for command, result in zip(["tail", "stats", "plot", "collect"], failures):
        assert result.stderr.startswith(f"hostcallback-consumer {command}: "), result.stderr


def test_tail_summarises_large_arrays_and_prints_them_whole_with_full(tmp_path):
    path = tmp_path / "big.hcbs"
    path.write_bytes(stream.dumps([TapRecord(name="w", step=0,
                                             value=np.ones((10, 32), np.float32))]))
    brief = cli("tail", str(path))
    assert brief.stdout.splitlines()[1] == "float32[10, 32] mean=1 min=1 max=1", brief.stdout
    full = cli("tail", "--full", str(path))
    assert len(full.stdout.splitlines()) > 10 and "mean=" not in full.stdout


def test_tail_name_keeps_only_the_named_series(tmp_path):
    path = tmp_path / "mixed.hcbs"
    path.write_bytes(stream.dumps([record(0, 0, 1.0), record(0, 0, 2.0, name="eval"),
                                   record(1, 0, 1.0)]))
    result = cli("tail", "--name", "ev*", str(path))
    assert result.stdout.splitlines()[0] == "device: TFRT_CPU_0 name: eval step: 0"
    assert len(result.stdout.splitlines()) == 2  # one record: its header and its value
    nothing = cli("tail", "--name", "nope", str(path))
    assert nothing.returncode == 0
    assert nothing.stderr == f"hostcallback-consumer tail: no records named nope in {path}\n"


@pytest.mark.parametrize("command", ["tail", "stats"])
def test_an_empty_stream_says_it_holds_no_records(tmp_path, command):
    path = tmp_path / "empty.hcbs"
    path.write_bytes(b"")
    result = cli(command, str(path))
    assert result.returncode == 0 and result.stdout == ""
    assert result.stderr == f"hostcallback-consumer {command}: no records in {path}\n"


def test_stats_of_records_without_numbers_says_so_rather_than_print_an_empty_table(tmp_path):
    path = tmp_path / "flags.hcbs"
    path.write_bytes(stream.dumps([TapRecord(name="flags", value={"done": np.bool_(True)})]))
    result = cli("stats", str(path))
    assert result.returncode == 0 and result.stdout == ""
    assert "no numbers in" in result.stderr and "tail shows the records" in result.stderr


def test_tail_n_0_prints_nothing_and_does_not_call_the_stream_empty(two_devices):
    result = cli("tail", "-n", "0", str(two_devices))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_tail_summarises_bfloat16_and_bool_arrays_too(tmp_path):
    path = tmp_path / "kinds.hcbs"
    path.write_bytes(stream.dumps([
        TapRecord(name="b", step=0, value=np.ones(32, ml_dtypes.bfloat16)),
        TapRecord(name="m", step=0, value=np.arange(32) % 2 == 0)]))
    lines = cli("tail", str(path)).stdout.splitlines()
    assert lines[1] == "bfloat16[32] mean=1 min=1 max=1"
    assert lines[3] == "bool[32] mean=0.5 min=0 max=1"


def test_plot_says_where_it_wrote(two_devices, tmp_path):
    out = tmp_path / "loss.png"
    result = cli("plot", str(two_devices), "--name", "train.loss", "-o", str(out))
    assert result.returncode == 0 and result.stdout == f"wrote {out}\n"


def test_hostcallback_help_shows_no_markup():
    result = subprocess.run([sys.executable, "-m", "hostcallback", "--help"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0 and "``" not in result.stdout
