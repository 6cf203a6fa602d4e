"""``sustain stack show|diff|history``, ``sustain drift`` and ``sustain capacity``: reading the
archive (one node's SQLite file or a fleet's PostgreSQL) from the command line.

Every handler returns its text; the CLI prints it. Problems the user can fix (an unknown stack id,
a bad ``--since``, an unreachable database) raise ``FleetUsageError``: one line, exit code 2.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine

from agent.archive.database import ArchiveError
from agent.archive.stack_snapshots import StackNotFound, find, history
from agent.reports import capacity, capacity_output
from agent.reports.capacity import parse_since
from agent.reports.runs import RunFilter, RunLine, recent_runs
from collectors.stack import StackSnapshot, capture, describe_diff, diff, flatten


class FleetUsageError(Exception):
    """One line for the user."""


def since(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        return parse_since(text, datetime.now(UTC))
    except ValueError as exc:
        raise FleetUsageError(str(exc)) from None


def _flat(facts: Any) -> list[str]:
    return [
        f"{path}: {'absent' if value is None else value}"
        for path, value in sorted(flatten(facts).items())
    ]


def stack_show(engine: Engine | None, reference: str | None, as_json: bool) -> str:
    """A stored stack (by id or prefix), or the stack of this machine now (no archive needed)."""
    if reference is not None:
        assert engine is not None
        try:
            stored = find(engine, reference)
        except StackNotFound as exc:
            raise FleetUsageError(str(exc)) from None
        stack_id, facts = stored.stack_id, stored.facts
    else:
        snapshot = _capture_here()
        stack_id, facts = snapshot.id, dict(snapshot.facts)
    if as_json:
        return json.dumps({"stack_id": stack_id, "facts": facts}, indent=2, sort_keys=True)
    return "\n".join([f"stack {stack_id}", *_flat(facts)])


def _capture_here() -> StackSnapshot:
    # Imported here: the probe runner, the stack tracker and NVML are what `stack show` needs to
    # read this machine; `capacity`, `runs` and `drift` start sooner without them.
    from agent.probes.runner import ProbeRunner
    from agent.stack.tracker import torch_facts_from_child
    from collectors.nvml.library import NvmlLibrary

    nvml = NvmlLibrary()
    try:
        return capture(torch_facts=torch_facts_from_child(ProbeRunner().python), nvml=nvml)
    finally:
        nvml.shutdown()


def stack_diff(engine: Engine, a: str, b: str) -> str:
    try:
        old, new = find(engine, a), find(engine, b)
    except StackNotFound as exc:
        raise FleetUsageError(str(exc)) from None
    changes = diff(old.facts, new.facts)
    head = f"stack {old.stack_id[:12]} -> {new.stack_id[:12]}"
    if not changes:
        return f"{head}: identical"
    return f"{head}: {len(changes)} difference(s)\n{describe_diff(changes)}"


def stack_history(engine: Engine, node: str | None, as_json: bool) -> str:
    changes = history(engine, node)
    if as_json:
        return json.dumps(
            [
                {
                    "node": c.node,
                    "at": c.occurred_at.isoformat(),
                    "old": c.old,
                    "new": c.new,
                    "summary": c.summary,
                }
                for c in changes
            ],
            indent=2,
        )
    if not changes:
        return "no stack recorded"
    lines = []
    for change in changes:
        old = change.old[:12] if change.old else "-"
        lines.append(
            f"{change.occurred_at:%Y-%m-%d %H:%M:%S}Z  {change.node}  {old} -> "
            f"{change.new[:12]}  {change.summary}"
        )
    return "\n".join(lines)


def drift_report(
    engine: Engine,
    *,
    since_text: str | None,
    node: str | None,
    window: int,
    max_pvalue: float,
    min_magnitude: float,
    history_size: int,
    outlier_ratio: float,
    as_json: bool,
) -> str:
    from agent.drift import detect as drift  # numpy and scipy: paid for by `sustain drift` alone

    start = since(since_text)
    try:
        everything = drift.load_history(engine, history=history_size)
        selected = {
            key: results for key, results in everything.items() if node is None or key[0] == node
        }
        stacks = drift.stack_facts(
            engine, (r.stack_id for results in selected.values() for r in results)
        )
    except ArchiveError as exc:
        raise FleetUsageError(str(exc)) from None
    drifts = drift.since_filter(
        drift.detect(
            selected, stacks, window=window, max_pvalue=max_pvalue, min_magnitude=min_magnitude
        ),
        start,
    )
    outliers = [o for o in drift.fleet_outliers(everything, outlier_ratio, node=node) if o.outlier]
    if as_json:
        return json.dumps(
            {
                "drifts": [d.as_dict() for d in drifts],
                "outliers": [o.as_dict() for o in outliers],
            },
            indent=2,
        )
    lines = [f"{len(drifts)} change(s) in sustained throughput"]
    for d in drifts:
        lines.append(
            f"{d.at:%Y-%m-%d %H:%M}Z  {d.node} {d.device_label}  "
            f"{d.workload} {d.precision} {d.optimization}  {d.direction} {d.change:+.1%}  "
            f"{d.cause}: {d.explanation}"
        )
    lines.append(f"{len(outliers)} fleet outlier(s) (more than {outlier_ratio:.0%} below peers)")
    for o in outliers:
        lines.append(
            f"{o.node} {o.device_label} ({o.device_model or 'unknown model'})  "
            f"{o.workload} {o.precision} {o.optimization}  {o.ratio:.1%} of the median of "
            f"{o.peers} identical devices"
        )
    return "\n".join(lines)


def capacity_report(
    engine: Engine,
    *,
    by: str,
    precision: str | None,
    workload: str | None,
    optimization: str | None,
    size: str | None = None,
    scope: str | None = None,
    since_text: str | None,
    as_json: bool,
    width: int | None = None,
) -> str:
    """The capacity table (``width``: the terminal's, else 80 columns) and under it the runs it
    rests on, by basis, and those left out, by reason; or all of it as one JSON object. Where no
    result matches, why: an empty archive, a filter value no result has, or the period (and the
    runs left out, where there were any)."""
    filters = {
        "precision": precision,
        "workload": workload,
        "optimization": optimization,
        "size": size,
        "scope": scope,
    }
    start = since(since_text)
    try:
        answer = capacity.capacity_with_runs(
            engine,
            by=by,
            precision=precision,
            workload=workload,
            optimization=optimization,
            size=size,
            scope=scope,
            since=start,
        )
        if as_json:
            return json.dumps(capacity_output.capacity_as_json(answer), indent=2)
        if not answer.rows:
            nothing = _nothing_matches(engine, filters, since_text, start)
            if not answer.runs.left_out_total:
                return nothing
            return f"{nothing}\n{capacity_output.render_runs(answer.runs)}"
    except ArchiveError as exc:
        raise FleetUsageError(str(exc)) from None
    table = capacity_output.render_table(
        answer.rows, by, width or shutil.get_terminal_size().columns
    )
    return f"{table}\n\n{capacity_output.render_runs(answer.runs)}"


def _nothing_matches(
    engine: Engine,
    filters: dict[str, str | None],
    since_text: str | None,
    start: datetime | None,
) -> str:
    asked = {name: value for name, value in filters.items() if value is not None}
    seen = capacity.overview(engine, asked)
    if seen.newest is None:
        return "the archive has no results yet: every analysed probe of `sustain run` adds one"
    unknown = [
        f"--{name} {shlex.quote(value)} (known: {', '.join(seen.known[name]) or 'none'})"
        for name, value in asked.items()
        if value not in seen.known[name]
    ]
    if unknown:
        return "no result matches " + "; ".join(unknown)
    if start is not None and seen.newest < start:
        return (
            f"no result since {start:%Y-%m-%d %H:%M}Z (--since {shlex.quote(since_text or '')}): "
            f"the newest ended {seen.newest:%Y-%m-%d %H:%M}Z"
        )
    flags = [f"--{name} {shlex.quote(value)}" for name, value in asked.items()]
    if since_text is not None:
        flags.append(f"--since {shlex.quote(since_text)}")
    return f"no result matches {' '.join(flags)} together"


def runs_list(engine: Engine, where: RunFilter, limit: int, as_json: bool) -> str:
    """``sustain runs``: the latest runs, newest first, a line each (or a JSON array)."""
    lines = recent_runs(engine, where, limit)
    if as_json:
        return json.dumps([_run_json(line) for line in lines], indent=2, allow_nan=False)
    if not lines:
        return "no probe runs in the archive match"
    width = max(80, min(shutil.get_terminal_size((100, 24)).columns, 160))
    cells = [
        (
            line.run_id[:RUN_ID_SHOWN],
            f"{line.started_at:%Y-%m-%d %H:%M:%S}",
            line.node,
            line.device_label,
            " ".join(
                [line.workload, line.precision]
                + ([line.optimization] if line.optimization != "eager" else [])
                + ([line.scope] if line.scope != "device" else [])
            ),
            line.outcome,
            _headline(line),
        )
        for line in lines
    ]
    header = ("RUN", "STARTED (UTC)", "NODE", "DEVICE", "PROBE", "OUTCOME", "FIGURE OR WHY")
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header) - 1)]
    room = max(20, width - sum(widths) - 2 * len(widths))
    text = []
    for row in [header, *cells]:
        fixed = "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:-1]))
        last = row[-1] if len(row[-1]) <= room else row[-1][: room - 3] + "..."
        text.append(f"{fixed}  {last}".rstrip())
    return "\n".join(text) + "\n(sustain report run RUN draws a run; --json shows every field)"


RUN_ID_SHOWN = 12  # as sustain report run takes a prefix of 4 or more hex digits


def _run_json(line: RunLine) -> dict[str, Any]:
    data = asdict(line)
    data["started_at"] = line.started_at.isoformat()
    data["uuid"] = data.pop("device")
    data["device"] = data.pop("device_label")
    return data


def _headline(line: RunLine) -> str:
    if line.steady_throughput is not None:
        return capacity_output.human(line.steady_throughput, line.unit)
    if line.p10_throughput is not None:
        return f"p10 {capacity_output.human(line.p10_throughput, line.unit)} (no steady state)"
    return line.reason or "-"


def emit(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
