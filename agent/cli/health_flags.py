"""The flags of `sustain health`, apart from the command so that building the parser imports
neither SQLAlchemy nor pydantic (every `sustain` command builds the whole parser)."""

from __future__ import annotations

import argparse

NPD_MESSAGE_LIMIT = 80  # node-problem-detector's default max_output_length


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="the verdict as JSON (default: text)")
    parser.add_argument(
        "--summary",
        action="store_true",
        help="only the first line, for node-problem-detector and Slurm (default: the summary, "
        "then one line per device)",
    )
    parser.add_argument(
        "--max-length",
        type=_length,
        default=NPD_MESSAGE_LIMIT,
        metavar="N",
        help=f"longest summary line (default {NPD_MESSAGE_LIMIT}: node-problem-detector's "
        "max_output_length)",
    )
    parser.add_argument(
        "--metrics",
        metavar="URL",
        help="the agent's /metrics (default: the configured exporter.listen address)",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="do not ask the running agent: the verdict recorded in the archive (default: ask "
        "it, and read the archive where it does not answer)",
    )


def _length(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 20 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"{value} is outside 20 to 4096")
    return value
