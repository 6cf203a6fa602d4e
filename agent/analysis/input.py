"""A user's series file for `sustain analyze`: CSV with a header, a JSON array, or JSON lines.

Every problem becomes a `SeriesInputError` whose message is one line naming the file and the
line (or array element) at fault, so the CLI can print it as is and exit 2.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from agent.analysis.result import SteadyStateResult
from agent.analysis.steady import DEFAULT_TOLERANCE, analyze, analyze_durations

Kind = Literal["duration", "throughput"]


class SeriesInputError(ValueError):
    """A series file that cannot be read as a series of positive finite numbers."""


def read_series(
    path: Path, column: str | None = None, kind: Kind = "duration"
) -> NDArray[np.float64]:
    """The values of `column` (or of the only numeric column) in file order."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SeriesInputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SeriesInputError(f"{path}: cannot read: {e}") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        pairs = _json_array(path, stripped, column)
    elif stripped.startswith("{"):
        pairs = _json_lines(path, text, column)
    else:
        pairs = _csv(path, text, column)
    if not pairs:
        raise SeriesInputError(f"{path}: no values")
    values = [_number(path, where, raw, kind) for where, raw in pairs]
    return np.asarray(values, dtype=np.float64)


def analyze_file(
    path: Path,
    column: str | None = None,
    kind: Kind = "duration",
    tolerance: float = DEFAULT_TOLERANCE,
) -> SteadyStateResult:
    values = read_series(path, column, kind)
    if kind == "duration":
        return analyze_durations(values, tolerance=tolerance)
    return analyze(values, tolerance=tolerance)


def _pick(path: Path, where: str, row: dict[str, object], column: str | None) -> object:
    if column is not None:
        if column not in row:
            raise SeriesInputError(f"{path}: {where}: no field {column!r}")
        return row[column]
    if len(row) != 1:
        names = ", ".join(sorted(row))
        raise SeriesInputError(
            f"{path}: {where}: several fields ({names}); choose one with --column"
        )
    return next(iter(row.values()))


def _json_array(path: Path, text: str, column: str | None) -> list[tuple[str, object]]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise SeriesInputError(f"{path}: line {e.lineno}: not valid JSON: {e.msg}") from None
    pairs: list[tuple[str, object]] = []
    for i, item in enumerate(document):
        where = f"element {i}"
        pairs.append((where, _pick(path, where, item, column) if isinstance(item, dict) else item))
    return pairs


def _json_lines(path: Path, text: str, column: str | None) -> list[tuple[str, object]]:
    pairs: list[tuple[str, object]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise SeriesInputError(f"{path}: {where}: not valid JSON: {e.msg}") from None
        pairs.append((where, _pick(path, where, item, column) if isinstance(item, dict) else item))
    return pairs


def _csv(path: Path, text: str, column: str | None) -> list[tuple[str, object]]:
    rows = csv.reader(text.splitlines())
    header = next(rows, None)
    if header is None:
        return []
    names = [name.strip() for name in header]
    if column is None:
        if len(names) != 1:
            raise SeriesInputError(
                f"{path}: line 1: several columns ({', '.join(names)}); choose one with --column"
            )
        index = 0
    elif column in names:
        index = names.index(column)
    else:
        raise SeriesInputError(f"{path}: line 1: no column {column!r} (have {', '.join(names)})")
    pairs: list[tuple[str, object]] = []
    for number, row in enumerate(rows, start=2):
        if not any(cell.strip() for cell in row):
            continue
        where = f"line {number}"
        if index >= len(row):
            raise SeriesInputError(f"{path}: {where}: no value in column {names[index]!r}")
        pairs.append((where, row[index].strip()))
    return pairs


def _number(path: Path, where: str, raw: object, kind: Kind) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise SeriesInputError(f"{path}: {where}: {raw!r} is not a number")
    try:
        value = float(raw)
    except ValueError:
        raise SeriesInputError(f"{path}: {where}: {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise SeriesInputError(f"{path}: {where}: {raw!r} is not a finite number")
    if value <= 0.0:
        raise SeriesInputError(f"{path}: {where}: {kind} {raw!r} is not positive")
    return value
