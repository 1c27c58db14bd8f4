"""hostcallback-consumer (or python -m hostcallback.consumer): collect record streams, and read
them (tail, stats, plot).

  collect --port P --out DIR        gather streams from many processes into DIR/<run>.hcbs
                                    (--port 0: a free port; it prints its address)
  tail FILE [-n N] [--follow]       print records as id_print would, large arrays summarised
       [--name N] [--full]          (--name: only these series, globs; --full: every element)
  stats FILE...                     per-series count, mean, min, max, last; per source too
  plot FILE... [--name N] -o OUT    line charts of scalar series against step, one line per
                                    source; --name repeats and takes globs, and without it
                                    every series is drawn (needs matplotlib)

A FILE stands for the stream and its rotated files (FILE.1, FILE.2, ...), read oldest first.

`hostcallback-consumer COMMAND --help` describes every option.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import os
import sys
import time
from collections.abc import Iterable, Iterator

from hostcallback.addons import format_metadata, format_value

from . import storage
from .cli_messages import PROG, complain
from .collect_command import add_collect_arguments, collect_command
from .plotting import plot
from .series import source_of
from .stats_sink import StatsSink, format_table
from .stream import StreamFormatError, TapRecord
from .stream_files import (
    expand_streams,
    follow_records,
    merged_records,
    read_records,
    read_stream,
    stream_files,
)

# Arrays with more elements than this print as one line of statistics unless --full is given.
SUMMARIZE_ABOVE = 16


def format_record(record: TapRecord, full: bool = True) -> str:
    fields = dict(record.metadata)
    fields["name"] = record.name
    if record.step is not None:
        fields["step"] = record.step
    if record.source:
        fields["source"] = record.source
    header = format_metadata(fields, tuple(record.transforms), record.device or None)
    return header + "\n" + format_value(record.value,
                                         summarize_above=None if full else SUMMARIZE_ABOVE)


def named(records: Iterable[TapRecord], names: list[str] | None) -> Iterator[TapRecord]:
    """The records whose name matches one of ``names`` (globs); all of them without names."""
    for record in records:
        if not names or any(fnmatch.fnmatchcase(record.name, name) for name in names):
            yield record


def tail(paths: str | list[str], follow: bool, poll_seconds: float = 0.2, out=None,
         last: int | None = None, names: list[str] | None = None, full: bool = True) -> int:
    """Prints a stream's records (those named ``names``, globs), oldest first; with ``last``,
    only the last ``last`` there are now. ``follow`` then prints every new record as it is
    written, across rotations (and parts, at a URL). Several streams (paths, URLs, globs) are
    read as one run, merged by process, device and sequence; they cannot be followed. Returns
    how many it printed."""
    streams = expand_streams([paths] if isinstance(paths, (str, os.PathLike)) else paths)
    if follow and len(streams) > 1:
        raise ValueError(f"--follow takes one stream; {len(streams)} were named "
                         f"({', '.join(streams[:3])}{', ...' if len(streams) > 3 else ''})")
    path = streams[0]
    out = out if out is not None else sys.stdout  # the one in force now, not at import
    printed = 0
    if follow and not storage.is_url(path) and not os.path.exists(path):
        # As `tail -F` does: a follower started before the run that writes the stream waits,
        # in a folder that is there (a mistyped one is an error, not a wait without end).
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            raise FileNotFoundError(2, "No such directory", folder)
        complain("tail", f"waiting for {path} to be written (Ctrl-C to stop)")
        while not os.path.exists(path):
            time.sleep(poll_seconds)

    def show(record: TapRecord) -> None:
        nonlocal printed
        print(format_record(record, full), file=out, flush=True)
        printed += 1

    if not follow:
        records = named(read_stream(path) if len(streams) == 1 else merged_records(streams),
                        names)
        for record in records if last is None else collections.deque(records, maxlen=last):
            show(record)
        return printed
    if last is None:
        for record in named(follow_records(path, poll_seconds), names):
            show(record)
        return printed
    # The last `last` records there are now, counted as the non-follow branch does (rotated files
    # too): the rotated files read whole, then the current file up to where the follower first
    # reaches the end of its data. What the follower yields after that is new.
    backlog: collections.deque[TapRecord] = collections.deque(maxlen=last)
    for name in stream_files(path)[:-1]:
        backlog.extend(named(read_records(name), names))
    caught_up = False

    def at_end() -> bool:
        nonlocal caught_up
        if not caught_up:
            caught_up = True
            for record in backlog:
                show(record)
        return False  # follow on

    for record in named(follow_records(path, poll_seconds, should_stop=at_end), names):
        if caught_up:
            show(record)
        else:
            backlog.append(record)
    return printed


def stats(paths: str | list[str]) -> str | None:
    """The per-series table over all records, then, when records come from more than one
    source (process/device), the same table per source; None when there are no records, and
    "" when none holds a number."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    merged, per_source = StatsSink(), collections.defaultdict(StatsSink)
    for path in expand_streams(paths):
        for record in read_stream(path):
            merged.emit(record)
            per_source[source_of(record)].emit(record)
    if not per_source:
        return None
    if not merged.summary():
        return ""
    text = format_table(merged.summary())
    if len(per_source) > 1:
        rows = sorted((name, source, row) for source, sink in per_source.items()
                      for name, row in sink.summary().items())
        width = max(len("source"), *(len(source) for source in per_source)) + 2
        numbers = "".join(f"{column:>14}" for column in ("mean", "min", "max", "last"))
        lines = [f"{'name':<32}{'source':<{width}}{'count':>8}{numbers}"]
        for name, source, row in rows:
            numbers = "".join(f"{row[column]:>14.6g}" for column in ("mean", "min", "max", "last"))
            lines.append(f"{name:<32}{source:<{width}}{row['count']:>8}{numbers}")
        text += "\n\nper source:\n" + "\n".join(lines)
    return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"hostcallback {version('hostcallback')}"
    except PackageNotFoundError:
        return "hostcallback (version unknown: not installed)"


def _smoothing(text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = float("nan")
    if not 0.0 <= weight < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1): 0 is no "
                                         "smoothing, 0.9 much")
    return weight


def _count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0: give how many "
                                         "records to show")
    return min(count, sys.maxsize)  # more than any stream holds: all of them


def _image_file(text: str) -> str:
    """An image file name whose suffix picks the format (matplotlib would add .png to one
    without, and write somewhere else than the name given)."""
    if not os.path.splitext(os.path.basename(text))[1] or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an image file name: give one with its "
                                         "format's suffix, such as loss.png, loss.svg, loss.pdf")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    collect = commands.add_parser("collect", help="gather streams from many processes",
                                  description="Serve until stopped (Ctrl-C), writing each run's "
                                  "records to OUT/<run>.hcbs.")
    add_collect_arguments(collect)
    tail_parser = commands.add_parser("tail", help="print a stream's records",
                                      description="Print records as id_print would.")
    tail_parser.add_argument("files", nargs="+", metavar="FILE",
                             help="a record stream (.hcbs) written by FileSink or the "
                             "collector: a path or an fsspec URL (s3://bucket/run/0.hcbs); "
                             "several, or a glob ('s3://bucket/run/*.hcbs'), are read as one "
                             "run, merged by process, device and sequence")
    tail_parser.add_argument("--follow", "-f", action="store_true",
                             help="keep reading as the stream grows, until Ctrl-C (one stream)")
    tail_parser.add_argument("-n", "--lines", type=_count, metavar="N",
                             help="print only the last N records (with --follow: the last N, "
                             "then every new one)")
    tail_parser.add_argument("--name", action="append", metavar="NAME",
                             help="only records of this name, or a glob (train*); repeat for "
                             "several")
    tail_parser.add_argument("--full", action="store_true",
                             help=f"print every element of arrays (default: arrays of more than "
                             f"{SUMMARIZE_ABOVE} elements as dtype, shape, mean, min and max)")
    stats_parser = commands.add_parser("stats", help="per-series summary table",
                                       description="Count, mean, min, max and last of every "
                                       "scalar series, over all records and per source "
                                       "(process/device) when there are several.")
    stats_parser.add_argument("files", nargs="+", metavar="FILE",
                              help="record streams: paths, fsspec URLs or globs of them; "
                              "several are read as one")
    plot_parser = commands.add_parser("plot", help="line charts of scalar series",
                                      description="One panel per series, one line per source "
                                      "(process/device), against step. Needs matplotlib.")
    plot_parser.add_argument("files", nargs="+", metavar="FILE",
                             help="record streams: paths, fsspec URLs or globs of them; "
                             "several are read as one")
    plot_parser.add_argument("--name", action="append", metavar="SERIES",
                             help="series to draw, as `stats` lists them (train.loss), or a "
                             "glob (train.*); repeat for several (default: every series)")
    plot_parser.add_argument("-o", "--output", required=True, type=_image_file,
                             help="image file to write; its suffix picks the format (.png, "
                             ".svg, .pdf)")
    plot_parser.add_argument("--logy", action="store_true", help="logarithmic y axis")
    plot_parser.add_argument("--smooth", type=_smoothing, default=0.0, metavar="W",
                             help="exponential smoothing weight in [0, 1) as in TensorBoard "
                             "(0.9: strong); the raw values stay as a faint line")
    plot_parser.add_argument("--overlay", action="store_true",
                             help="draw every series in one panel instead of one panel each")
    plot_parser.add_argument("--title", help="figure title (default: the series or file name)")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.command == "collect":
        return collect_command(args)
    if args.command == "tail":
        try:
            printed = tail(args.files, args.follow, last=args.lines, names=args.name,
                           full=args.full)
        except KeyboardInterrupt:
            return 0
        except StreamFormatError:
            raise
        except ValueError as error:  # --follow of several streams
            complain("tail", str(error))
            return 2
        if not printed and args.lines != 0:
            which = f" named {', '.join(args.name)}" if args.name else ""
            complain("tail", f"no records{which} in {' '.join(args.files)}")
        return 0
    if args.command == "stats":
        table = stats(args.files)
        if table is None:
            complain("stats", f"no records in {' '.join(args.files)}")
        elif not table:
            complain("stats", f"no numbers in {' '.join(args.files)}: its records hold no real "
                     "numbers (stats keeps those; tail shows the records)")
        else:
            print(table)
        return 0
    code = plot(args.files, args.name or ["*"], args.output, logy=args.logy, smoothing=args.smooth,
                overlay=args.overlay, title=args.title)
    if code == 0:
        print(f"wrote {args.output}")
    return code


def main(argv: list[str] | None = None) -> int:
    """Runs a command; expected failures (a missing file, bytes that are not a stream, a reader
    that went away) end with one line on stderr and a non-zero exit code, never a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except BrokenPipeError:
        # The reader went away (`tail ... | head`): stop quietly, as cat and grep do, with the
        # shell's code for SIGPIPE. Python would otherwise complain again flushing stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130
    except StreamFormatError as error:
        complain(args.command, f"{_files(args)} is not a readable record stream: {error}")
        return 1
    except ImportError as error:  # a URL whose filesystem needs a package not installed
        complain(args.command, str(error))
        return 1
    except OSError as error:
        where = f": {error.filename}" if error.filename else ""
        complain(args.command, f"{error.strerror or error}{where}")
        return 1


def _files(args: argparse.Namespace) -> str:
    return " ".join(getattr(args, "files", []))


if __name__ == "__main__":
    sys.exit(main())
