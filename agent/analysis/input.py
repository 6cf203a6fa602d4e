"""A user's series file for `sustain analyze`: CSV, a JSON array, or JSON lines.

A CSV file may have a header line or not: when its first line is all numbers it is data, and its
columns go by number (1, 2, ...). Every problem becomes a `SeriesInputError` whose message is one
line naming the file (or "stdin") and the line (or array element) at fault, so the CLI can print
it as is and exit 2. What a message quotes from the file is escaped (no line breaks) and cut
short. Input that is no series at all (nothing, one JSON object, text) is named as such rather
than analysed as a series of one.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from agent.analysis.result import SteadyStateResult
from agent.analysis.steady import DEFAULT_TOLERANCE, analyze, analyze_durations

Kind = Literal["duration", "throughput"]

# Values outside this range are no plausible duration or throughput in any unit, and the analysis
# (reciprocals, sums and squares of the series) overflows on values far outside it.
SMALLEST_VALUE = 1e-30
LARGEST_VALUE = 1e30
MAX_FILE_BYTES = 256 << 20  # a longer file is no series (or is a device such as /dev/zero)
MAX_SHOWN = 60  # characters of the file that a message quotes
MAX_NAMES_SHOWN = 120  # characters of the column or field names that a message lists


class SeriesInputError(ValueError):
    """A series file that cannot be read as a series of positive finite numbers."""


def read_series(
    path: Path | None, column: str | None = None, kind: Kind = "duration"
) -> NDArray[np.float64]:
    """The values of `column` (or of the only column) in file order; `path` None reads
    standard input (the command line's "-")."""
    name = "stdin" if path is None else _text(str(path), limit=None)
    if path is None and sys.stdin is None:  # started with its standard input closed
        raise SeriesInputError(f"{name}: closed")
    try:
        if path is None:
            data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
        else:
            with path.open("rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise SeriesInputError(f"{name}: no such file") from None
    except OSError as e:
        raise SeriesInputError(f"{name}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SeriesInputError(f"{name}: larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8-sig")  # a byte order mark is no part of the first name
    except UnicodeDecodeError as e:
        raise SeriesInputError(
            f"{name}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})"
        ) from None
    stripped = text.lstrip()
    if not stripped:
        raise SeriesInputError(f"{name}: empty: no series to analyze")
    if stripped.startswith("["):
        pairs = _json_array(name, stripped, column)
    elif stripped.startswith("{"):
        pairs = _json_lines(name, text, column)
    else:
        pairs = _csv(name, text, column)
    if not pairs:
        raise SeriesInputError(f"{name}: no values")
    values = [_number(name, where, raw, kind) for where, raw in pairs]
    return np.asarray(values, dtype=np.float64)


def analyze_file(
    path: Path | None,
    column: str | None = None,
    kind: Kind = "duration",
    tolerance: float = DEFAULT_TOLERANCE,
) -> SteadyStateResult:
    values = read_series(path, column, kind)
    if kind == "duration":
        return analyze_durations(values, tolerance=tolerance)
    return analyze(values, tolerance=tolerance)


def _text(text: str, limit: int | None = MAX_SHOWN) -> str:
    """Text from the file for a one-line message: escaped where it holds line breaks or other
    unprintable characters, and cut to `limit` characters."""
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


def _shown(raw: object) -> str:
    """A value from the file as a message quotes it: its repr (one line), cut short."""
    if isinstance(raw, list):
        return "an array"
    if isinstance(raw, dict):
        return "an object"
    text = repr(raw)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _names(names: list[str]) -> str:
    shown = _text(", ".join(names), limit=None)
    if len(shown) <= MAX_NAMES_SHOWN:
        return shown
    return f"{shown[:MAX_NAMES_SHOWN]}... ({len(names)} in all)"


def _pick(name: str, where: str, row: dict[str, object], column: str | None) -> object:
    if column is not None:
        if column not in row:
            raise SeriesInputError(f"{name}: {where}: no field {_shown(column)}")
        return row[column]
    if not row:
        raise SeriesInputError(f"{name}: {where}: an object without fields")
    if len(row) != 1:
        raise SeriesInputError(
            f"{name}: {where}: several fields ({_names(sorted(row))}); choose one with --column"
        )
    return next(iter(row.values()))


def _json_int(text: str) -> int | float:
    # An integer too long for a float becomes inf, rejected below as not finite, instead of
    # tripping int()'s digit limit (a ValueError that json does not wrap).
    return int(text) if len(text) < 20 else float(text)


def _parse_json(text: str) -> object:
    """One JSON value; nesting too deep for the parser is a JSONDecodeError like any other."""
    try:
        return json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def _json_array(name: str, text: str, column: str | None) -> list[tuple[str, object]]:
    try:
        document = _parse_json(text)
    except json.JSONDecodeError as e:
        raise SeriesInputError(f"{name}: line {e.lineno}: not valid JSON: {e.msg}") from None
    assert isinstance(document, list)  # the text starts with "["
    pairs: list[tuple[str, object]] = []
    for i, item in enumerate(document):
        where = f"element {i}"
        pairs.append((where, _pick(name, where, item, column) if isinstance(item, dict) else item))
    return pairs


def _json_lines(name: str, text: str, column: str | None) -> list[tuple[str, object]]:
    if _one_json_value(text):
        raise SeriesInputError(
            f"{name}: one JSON object, not a series (a series is a JSON array, JSON lines with "
            "one object per line, or CSV)"
        )
    pairs: list[tuple[str, object]] = []
    # Lines end at "\n" alone: a JSON string may hold the other breaks that splitlines() knows.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            item = _parse_json(line)
        except json.JSONDecodeError as e:
            raise SeriesInputError(f"{name}: {where}: not valid JSON: {e.msg}") from None
        pairs.append((where, _pick(name, where, item, column) if isinstance(item, dict) else item))
    return pairs


def _one_json_value(text: str) -> bool:
    """Whether the whole text is a single JSON value, as opposed to JSON lines."""
    try:
        _parse_json(text)
    except json.JSONDecodeError:
        return False  # several values (JSON lines), or a mistake the line-by-line reading names
    return True


def _csv(name: str, text: str, column: str | None) -> list[tuple[str, object]]:
    rows = csv.reader(text.splitlines())
    try:
        first = next(rows, None)
        while first is not None and not any(cell.strip() for cell in first):
            first = next(rows, None)  # blank lines before the first row
        if first is None:
            return []
        cells = [cell.strip() for cell in first]
        where = f"line {rows.line_num}"
        headed = not all(_is_number(cell) for cell in cells if cell)
        names = cells if headed else [str(number) for number in range(1, len(cells) + 1)]
        index = _column_index(name, where, names, column, headed)
        pairs: list[tuple[str, object]] = [] if headed else [(where, cells[index])]
        for row in rows:
            if not any(cell.strip() for cell in row):
                continue
            where = f"line {rows.line_num}"
            if index >= len(row):
                raise SeriesInputError(
                    f"{name}: {where}: no value in column {_shown(names[index])}"
                )
            pairs.append((where, row[index].strip()))
    except csv.Error as e:  # a field longer than the csv module's limit
        raise SeriesInputError(f"{name}: line {rows.line_num}: not valid CSV: {e}") from None
    if headed and not pairs:
        header = _shown(", ".join(cells))
        raise SeriesInputError(f"{name}: no values: only a header line ({header})")
    return pairs


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _column_index(name: str, where: str, names: list[str], column: str | None, headed: bool) -> int:
    have = _names(names) if headed else f"{_names(names)}: no header line, columns go by number"
    if column is None:
        if len(names) != 1:
            raise SeriesInputError(
                f"{name}: {where}: several columns ({have}); choose one with --column"
            )
        return 0
    if column not in names:
        raise SeriesInputError(f"{name}: {where}: no column {_shown(column)} (have {have})")
    return names.index(column)


def _number(name: str, where: str, raw: object, kind: Kind) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise SeriesInputError(f"{name}: {where}: {_shown(raw)} is not a number")
    try:
        value = float(raw)
    except (ValueError, OverflowError):
        raise SeriesInputError(f"{name}: {where}: {_shown(raw)} is not a number") from None
    if not math.isfinite(value):
        raise SeriesInputError(f"{name}: {where}: {_shown(raw)} is not a finite number")
    if value <= 0.0:
        raise SeriesInputError(f"{name}: {where}: {kind} {_shown(raw)} is not positive")
    if not SMALLEST_VALUE <= value <= LARGEST_VALUE:
        raise SeriesInputError(
            f"{name}: {where}: {kind} {_shown(raw)} is outside the range the analysis takes "
            f"({SMALLEST_VALUE:g} to {LARGEST_VALUE:g})"
        )
    return value
