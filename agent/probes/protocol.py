"""The child's JSON lines as the agent reads them: one object per line, each checked before it
is trusted (workloads/README.md is the contract; agent/probes/runner.py runs the child).

Junk is counted, never trusted: a line that is not JSON, NaN or Infinity anywhere, a number no
float holds, an unknown event, a field of the wrong type, an iteration that ends before it starts.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn

MAX_LINE_BYTES = 1 << 20  # a longer stdout line is not a protocol line
REASON_CHARS = 500  # of a reason the child wrote, one line


@dataclass(frozen=True, slots=True)
class Iteration:
    index: int
    start: float
    end: float
    work: float
    phase: str | None = None


_LARGEST_INT = int(sys.float_info.max)


def _json_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: the child writes allow_nan=False


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a float")
    return value


def _json_int(text: str) -> int:
    value = int(text)  # a ValueError past int()'s digit limit
    if abs(value) > _LARGEST_INT:
        raise ValueError("an integer that does not fit a float")
    return value


_NUMBER = (int, float)
# What the agent reads of each line, and the JSON types it must have where present (null is
# allowed): a line that breaks this is junk, counted, never trusted. Numbers of a result are
# also non-negative.
_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "manifest": {
        "workload": (str,),
        "unit": (str,),
        "work_unit": (str,),
        "device_name": (str,),
        "torch": (str,),
        "python": (str,),
        "kernel": (str,),
        "threads": (int,),
        "backends": (dict,),
        "shapes": (dict,),
        "parameters": (dict,),
        "min_iterations": (int,),
        "fit": (dict,),
        "native_reason": (str,),
        "reference": (dict,),
        "slow_path": (str,),
    },
    "result": {
        "iterations": (int,),
        "duration": _NUMBER,
        "elapsed": _NUMBER,
        "work": _NUMBER,
        "throughput": _NUMBER,
        "prefill_tokens_per_second": _NUMBER,
        "decode_tokens_per_second": _NUMBER,
        "kernel": (str,),
        "phases": (dict,),
        "latency_seconds": (dict,),
    },
    "unsupported": {"reason": (str,)},
}


def _fits(message: Mapping[str, Any], event: str) -> bool:
    for name, types in _FIELD_TYPES[event].items():
        value = message.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            return False
        if event == "result" and isinstance(value, _NUMBER) and value < 0:
            return False
    return True


class LineProtocol:
    """Parses the child's stdout lines; tolerant of junk, which it counts instead of trusting.

    Junk is anything but one JSON object per line as workloads/README.md describes it: a line
    that is not JSON (binary, another encoding, truncated, too long, nested too deeply), NaN or
    Infinity anywhere (the child never writes them), a number no float can hold, an unknown
    event, a field of the wrong type, an iteration that ends before it starts or has negative
    work. ``feed`` never raises on what the child wrote.
    """

    def __init__(self, on_iteration: Callable[[Iteration], None] | None) -> None:
        self.manifest: dict[str, Any] | None = None
        self.measuring_since: float | None = None  # monotonic; the manifest's arrival
        self.result: dict[str, Any] | None = None
        self.unsupported: str | None = None
        self.iterations: list[Iteration] = []
        self.errors = 0
        self._on_iteration = on_iteration
        # Gated (a start barrier): the measured run begins when the child is released, not at
        # its manifest; ``measuring_since`` is then set by the releaser.
        self.gated = False
        self.manifest_seen = threading.Event()  # what a start barrier waits for

    def feed(self, raw: bytes) -> None:
        message = self._parse(raw)
        event = None if message is None else message.get("event")
        if message is None or event not in ("manifest", "iteration", "result", "unsupported"):
            self.errors += 1
        elif event == "iteration":
            iteration = self._iteration(message)
            if iteration is None:
                self.errors += 1
                return
            self.iterations.append(iteration)
            if self._on_iteration is not None:
                self._on_iteration(iteration)
        elif not _fits(message, event):
            self.errors += 1
        elif event == "manifest":
            if self.manifest is None and not self.gated:
                self.measuring_since = time.monotonic()
            self.manifest = message
            self.manifest_seen.set()
        elif event == "result":
            self.result = message
        else:
            self.unsupported = one_line(message.get("reason")) or "unsupported"

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any] | None:
        if len(raw) > MAX_LINE_BYTES:
            return None
        try:
            message = json.loads(
                raw,
                parse_constant=_json_constant,
                parse_float=_json_float,
                parse_int=_json_int,
            )
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None
        return message if isinstance(message, dict) else None

    @staticmethod
    def _iteration(message: Mapping[str, Any]) -> Iteration | None:
        index = message.get("index")
        phase = message.get("phase")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            return None
        if phase is not None and not isinstance(phase, str):
            return None
        values: list[float] = []
        for name in ("start", "end", "work"):
            value = message.get(name)
            if isinstance(value, bool) or not isinstance(value, _NUMBER):
                return None
            values.append(float(value))
        start, end, work = values
        if not all(math.isfinite(v) for v in values) or end < start or work < 0:
            return None
        return Iteration(index, start, end, work, phase)


def one_line(text: object) -> str:
    """What the child wrote, fit for a run's reason: one printable line, of a bounded length."""
    line = " ".join(str(text or "").split())
    if not line.isprintable():
        line = repr(line)[1:-1]
    return line[:REASON_CHARS]


def analysed_count(iterations: Sequence[Iteration]) -> int:
    """The iterations the analysis reads: those of the most frequent phase (all, unphased)."""
    counts = Counter(iteration.phase for iteration in iterations)
    return counts.most_common(1)[0][1] if counts else 0


def lines_of(stream: IO[bytes], limit: int) -> Iterator[bytes]:
    """The lines of ``stream``; of a line longer than ``limit`` bytes only the first
    ``limit + 1`` come (newline included where it fits), the rest is read and dropped in
    pieces, so a child that writes gigabytes without a newline costs no memory."""
    while raw := stream.readline(limit + 1):
        yield raw
        while len(raw) > limit and not raw.endswith(b"\n"):
            raw = stream.readline(limit + 1)
