"""Standard output whose reader went away (`sustain ... | head`)."""

from __future__ import annotations

import os
import sys

EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command that SIGPIPE ended


def closed_pipe() -> int:
    """Stop writing without a traceback: standard output goes to /dev/null from here on, so that
    what is left (archiving, plots, Python's flush at exit) finishes quietly. Returns the status
    of a command that SIGPIPE ended."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_CLOSED_PIPE
