"""``sustain stack show|diff|history``, ``sustain drift`` and ``sustain capacity``: reading the
archive (one node's SQLite file or a fleet's PostgreSQL) from the command line.

Every handler returns its text; the CLI prints it. Problems the user can fix (an unknown stack id,
a bad ``--since``, an unreachable database) raise ``FleetUsageError``: one line, exit code 2.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine

from agent.archive.database import ArchiveError
from agent.archive.stacks import StackNotFound, find, history
from agent.probes import ProbeRunner
from agent.stacks import torch_facts_from_child
from collectors.nvml import NvmlLibrary
from collectors.stack import StackSnapshot, capture, describe_diff, diff, flatten


class FleetUsageError(Exception):
    """One line for the user."""


def since(text: str | None) -> datetime | None:
    from agent.capacity import parse_since  # noqa: PLC0415 - numpy only when asked

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
    from agent import drift  # noqa: PLC0415 - numpy and scipy only for this command

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
    since_text: str | None,
    as_json: bool,
) -> str:
    from agent import capacity  # noqa: PLC0415 - numpy only for this command

    try:
        rows = capacity.capacity(
            engine,
            by=by,
            precision=precision,
            workload=workload,
            optimization=optimization,
            since=since(since_text),
        )
    except ArchiveError as exc:
        raise FleetUsageError(str(exc)) from None
    if as_json:
        return json.dumps(capacity.rows_as_json(rows), indent=2)
    if not rows:
        return "no analysed probe results match"
    return capacity.render_table(rows, by)


def emit(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
