"""How the command line names itself: one prefix for every subcommand's errors."""

from __future__ import annotations

import sys

PROG = "hostcallback-consumer"


def complain(command: str, message: str) -> None:
    """One line on stderr: ``hostcallback-consumer COMMAND: message``."""
    print(f"{PROG} {command}: {message}", file=sys.stderr)
