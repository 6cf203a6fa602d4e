"""The child's half of the contract with the agent: JSON lines on the real standard output.

The agent parses every stdout line as JSON, so nothing else may reach it. A C library, a torch
warning printed with print(), a compiler's chatter: any of them would corrupt the stream. The
emitter therefore takes the real stdout for itself and points file descriptor 1 at stderr, where
stray output does no harm (the agent keeps the last stderr lines for failed runs).

Each line is flushed as it is written so that the agent sees progress and keeps the iterations
of a child that dies mid-run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any


class Unsupported(Exception):
    """The device cannot run this workload or precision; reported as such, exit code 0."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Emitter:
    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    @classmethod
    def claim_stdout(cls) -> Emitter:
        """Keep the real stdout for the protocol; whatever else writes to fd 1 goes to stderr."""
        sys.stdout.flush()
        protocol_fd = os.dup(1)
        os.dup2(2, 1)
        return cls(os.fdopen(protocol_fd, "w", encoding="utf-8"))

    def emit(self, record: dict[str, Any]) -> None:
        # allow_nan=False: NaN and Infinity are not JSON, and a number the agent cannot parse is
        # worse than a traceback.
        self._stream.write(json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n")
        self._stream.flush()
