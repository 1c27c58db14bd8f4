"""hostcallback demo (or python -m hostcallback demo): runs the demo training loop.

The command line sits above every layer: the demo is written on the consumers
(hostcallback.consumer.demo), as a user's program would be.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hostcallback", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model, tapping loss and gradient norm")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    demo.add_argument("--out", default="hostcallback-demo",
                      help="where the record stream and loss plot go (default hostcallback-demo/)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from hostcallback.consumer import demo as demo_module

        demo_module.run(steps=args.steps, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
