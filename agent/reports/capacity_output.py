"""How ``sustain capacity`` shows its answer (agent.reports.capacity): a table that fits the
terminal, a section per probe and basis, and under it the runs it rests on and those it left
out; or all of it as JSON. ``human`` (four significant digits and an SI prefix) is the figures'
form wherever people read them: the fleet report and the landing page too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from itertools import groupby
from typing import Any

from agent.reports.capacity import SCOPE_SHOWN, Capacity, CapacityRow, RunsCounted

LEFT_OUT_SHOWN = {"no_figure": "ok without a figure"}
"""A reason a run was left out, in words where its name is not (LEFT_OUT_REASONS)."""

_PREFIXES = {-3: "n", -2: "µ", -1: "m", 0: "", 1: "k", 2: "M", 3: "G", 4: "T", 5: "P", 6: "E"}


def _scaled(value: float) -> tuple[str, str]:
    """Four significant digits and the SI prefix that goes with them: ``("812.3", "T")``."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}", ""
    power = max(min(math.floor(math.log10(abs(value)) / 3), 6), -3)
    scaled = value / 1000.0**power
    if round(abs(scaled), 1) >= 1000 and power < 6:  # 999.96 would print as 1000.0
        power += 1
        scaled = value / 1000.0**power
    size = abs(scaled)
    digits = 1 if round(size, 2) >= 100 else 2 if round(size, 3) >= 10 else 3
    return f"{scaled:.{digits}f}", _PREFIXES[power]


def human(value: float, unit: str | None) -> str:
    """``812.3 TFLOP/s``: four significant digits and an SI prefix on the unit."""
    number, prefix = _scaled(value)
    return f"{number} {prefix}{unit or ''}".rstrip()


def _figure(value: float) -> str:
    """A table cell of a section whose heading gives the unit: ``812.3 T``, ``12.50  `` (a blank
    where the prefix would be, so that the digits line up)."""
    number, prefix = _scaled(value)
    return f"{number} {prefix or ' '}"


STACK_ID_SHOWN = 12
"""Characters of a stack id in the table (a SHA-256: as unique as a short git hash)."""

TABLE_WIDTH = 80
"""The width the table fits when the caller knows none (no terminal)."""

# The columns after the group's (model, node or stack), as in ``_cells``; the first ``_LEFT``
# columns, the group's included, are words (left-aligned), the others numbers.
_HEADER = ("SIZE", "SCOPE", "MEDIAN", "P10", "SPEC", "RESULTS", "DEVICES")
_LEFT = 3
_GROUP_ROOM = 12
"""The narrowest group column worth a table: below it, a block per row."""


P10_HEADING = "p10 basis (no steady state)"
"""What the heading of a section of p10-basis rows adds: their figures are the runs' p10s."""


def _heading(row: CapacityRow) -> str:
    unit = row.unit or "unit not recorded"
    heading = f"{row.workload} {row.precision} {row.optimization} ({unit})"
    return heading if row.basis == "steady" else f"{heading}, {P10_HEADING}"


def _cells(row: CapacityRow, by: str, *, units: bool = False) -> tuple[str, ...]:
    """The row's cells: figures with their prefix only (``units``: and with the unit)."""
    group = row.group if row.group is not None else "-"
    if by == "stack" and row.group is not None:
        group = group[:STACK_ID_SHOWN]

    def figure(value: float) -> str:
        return human(value, row.unit) if units else _figure(value)

    return (
        group,
        row.size or "-",
        SCOPE_SHOWN.get(row.scope, row.scope),
        figure(row.median),
        figure(row.p10),
        f"{row.spec_ratio:.1%}" if row.spec_ratio is not None else "-",
        str(row.results),
        str(row.devices),
    )


def render_table(rows: Sequence[CapacityRow], by: str = "model", width: int = TABLE_WIDTH) -> str:
    """A section per probe (workload, precision, optimization, with the unit of its figures in
    the heading) and basis (the steady one first; a p10 one says so in its heading), and in it
    a line per group, size and scope (SCOPE_SHOWN: solo, node-wide, node-total), numbers
    right-aligned with an SI prefix.

    Nothing is ever cut to fit ``width``: a group name too long for its column (at 80 columns,
    over about 21 characters, 16 beside node-wide rows, as many model names are) stands on a
    line of its own, its figures on the next, as df puts a long file system name; where not even
    the figures fit, every row becomes a block of one column a line.
    """
    if not rows:
        return "no probe results match"
    header = (by.upper(), *_HEADER)
    table = [header, *(_cells(row, by) for row in rows)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    room = width - sum(widths[1:]) - 2 * (len(widths) - 1)
    if room < _GROUP_ROOM:
        return _blocks(rows, header, by)
    widths[0] = min(widths[0], room)

    def lines(cells: tuple[str, ...]) -> list[str]:
        if len(cells[0]) > widths[0]:
            return [cells[0], *lines(("", *cells[1:]))]
        return [
            "  ".join(
                cell.ljust(size) if i < _LEFT else cell.rjust(size)
                for i, (cell, size) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        ]

    return "\n\n".join(
        "\n".join(
            [heading, *lines(header), *(line for row in members for line in lines(_cells(row, by)))]
        )
        for heading, members in groupby(rows, key=_heading)
    )


def _blocks(rows: Sequence[CapacityRow], header: tuple[str, ...], by: str) -> str:
    """The vertical layout: under each section's heading, a block per row, a line per column."""
    pad = max(len(label) for label in header) + 2
    return "\n\n".join(
        heading
        + "\n"
        + "\n\n".join(
            "\n".join(
                f"  {label.ljust(pad)}{value}"
                for label, value in zip(header, _cells(row, by, units=True), strict=True)
            )
            for row in members
        )
        for heading, members in groupby(rows, key=_heading)
    )


def rows_as_json(rows: Iterable[CapacityRow]) -> list[dict[str, Any]]:
    """The rows as JSON objects, with full precision and full stack ids."""
    return [asdict(row) for row in rows]


def capacity_as_json(answer: Capacity) -> dict[str, Any]:
    """``{"rows": [...], "runs": {"used": {"steady": N, "p10": N}, "left_out": {reason: N}}}``:
    the rows (``rows_as_json``) and the runs behind them, every reason of LEFT_OUT_REASONS
    present."""
    return {"rows": rows_as_json(answer.rows), "runs": answer.runs.as_json()}


def render_runs(runs: RunsCounted) -> str:
    """Two lines: the runs the figures rest on, by basis, and those left out, by reason::

    runs used: 12 (11 on a steady basis, 1 on a p10 basis)
    runs left out: 3 (2 timeout, 1 failed)
    """
    used = f"runs used: {runs.used} ({runs.steady} on a steady basis, {runs.p10} on a p10 basis)"
    reasons = [
        f"{count} {LEFT_OUT_SHOWN.get(reason, reason)}"
        for reason, count in runs.left_out.items()
        if count
    ]
    left_out = f"{runs.left_out_total} ({', '.join(reasons)})" if reasons else "none"
    return f"{used}\nruns left out: {left_out}"
