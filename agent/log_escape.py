"""Log lines that control characters cannot rewrite.

NVML strings (device names, XID messages), pod names and paths reach the log through ``%s``: an
ESC there would repaint the operator's terminal, a CR or a newline would overwrite a line or
forge one. The formatter writes every C0 control character but tab, and DEL, as ``\\xNN``, in the
message only: a traceback the agent logs keeps its lines::

    2025-11-20 10:00:00,000 WARNING collectors.nvml: GPU 0: \\x1b[2Jname\\x0d
"""

from __future__ import annotations

import logging

_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F) if code != ord("\t")}


def escape(text: str) -> str:
    return text.translate(_ESCAPES)


class EscapingFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose message part has its control characters escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        plain = record.message  # set by format() from getMessage()
        record.message = escape(plain)
        try:
            return super().formatMessage(record)
        finally:
            record.message = plain  # the record is shared with any other handler
