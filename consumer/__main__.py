"""python -m consumer: collect streams, and read them (tail, stats, plot).

  collect --port P --out DIR    gather streams from many processes into DIR/<run>.hcbs
                                (--port 0: a free port; it prints its address)
  tail FILE [--follow]          print records as id_print would (--follow follows rotation)
  stats FILE                    per-name count, mean, min, max, last
  plot FILE --name N -o OUT     a line chart of a scalar series against step (needs matplotlib)
"""

from __future__ import annotations

import argparse
import sys

from consumer.collector import add_collect_arguments, collect_command
from consumer.sinks import StatsSink, format_table, scalar_series
from consumer.stream import TapRecord, follow_records, read_records
from hostcallback.printing import format_metadata, format_value


def format_record(record: TapRecord) -> str:
    fields = dict(record.metadata)
    fields["name"] = record.name
    if record.step is not None:
        fields["step"] = record.step
    if record.source:
        fields["source"] = record.source
    header = format_metadata(fields, tuple(record.transforms), record.device or None)
    return header + "\n" + format_value(record.value)


def tail(path: str, follow: bool, poll_seconds: float = 0.2, out=sys.stdout) -> None:
    records = follow_records(path, poll_seconds) if follow else read_records(path)
    for record in records:
        print(format_record(record), file=out, flush=True)


def stats(path: str) -> str:
    sink = StatsSink()
    for record in read_records(path):
        sink.emit(record)
    return format_table(sink.summary())


def plot(path: str, name: str, output: str) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot needs matplotlib: pip install 'hostcallback[plot]'", file=sys.stderr)
        return 2
    steps, values = [], []
    for record in read_records(path):
        series = scalar_series(record)
        if name in series:
            steps.append(record.step if record.step is not None else len(steps))
            values.append(series[name])
    if not values:
        print(f"no series named {name!r} in {path}; `python -m consumer stats {path}` lists them",
              file=sys.stderr)
        return 1
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(steps, values)
    axes.set_xlabel("step")
    axes.set_ylabel(name)
    axes.set_title(name)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m consumer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    collect = commands.add_parser("collect", help="gather streams from many processes")
    add_collect_arguments(collect)
    tail_parser = commands.add_parser("tail", help="print a stream's records")
    tail_parser.add_argument("file")
    tail_parser.add_argument("--follow", "-f", action="store_true")
    stats_parser = commands.add_parser("stats", help="per-name summary table")
    stats_parser.add_argument("file")
    plot_parser = commands.add_parser("plot", help="line chart of a scalar series")
    plot_parser.add_argument("file")
    plot_parser.add_argument("--name", required=True)
    plot_parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)

    if args.command == "collect":
        return collect_command(args)
    if args.command == "tail":
        try:
            tail(args.file, args.follow)
        except KeyboardInterrupt:
            pass
        return 0
    if args.command == "stats":
        print(stats(args.file))
        return 0
    return plot(args.file, args.name, args.output)


if __name__ == "__main__":
    sys.exit(main())
