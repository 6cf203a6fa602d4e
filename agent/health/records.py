"""What the archive knows about health: the fleet baseline of a probe, a device's own recent
results, operators' acknowledgements, XIDs since boot and the verdicts last recorded.

The daemon and ``sustain health`` (with or without the daemon) read through these functions, so
both reach the same verdict from the same rows.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Engine, and_, func, select
from sqlalchemy.orm import Session

from agent.archive import fleet_baselines
from agent.archive.models import EventRecord, ProbeRunRecord, TelemetryRollup
from agent.health.rules import Finding

HEALTH_CHANGE = "health_change"
HEALTH_CLEAR = "health_clear"


@dataclass(frozen=True, slots=True)
class ProbeIdentity:
    """What makes two results comparable: the probe, its size, the device model and the stack."""

    workload: str
    precision: str
    optimization: str
    size: str
    model: str
    stack_id: str

    @property
    def name(self) -> str:
        return f"{self.workload} {self.precision} {self.optimization}"


@dataclass(frozen=True, slots=True)
class OwnResult:
    ended_at: float
    steady: float | None
    ratio: float | None
    unit: str


@dataclass(frozen=True, slots=True)
class Baseline:
    """The peers' medians: other devices' latest results of the same identity."""

    steady: float | None
    ratio: float | None
    peers: int


@dataclass(frozen=True, slots=True)
class Clear:
    """An operator's acknowledgement (``sustain health clear``)."""

    id: str
    device: str
    at: float
    reasons: tuple[str, ...]
    by: str
    why: str


@dataclass(frozen=True, slots=True)
class Recorded:
    """The last verdict the agent recorded for one device."""

    device: str
    label: str
    uuid: str
    name: str
    at: float  # when it was recorded
    state: str
    findings: tuple[dict[str, Any], ...]
    evidence_at: float = 0.0  # the latest sign the verdict still held: a rollup of the device


def _time(value: datetime) -> float:
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


def baseline(
    engine: Engine, identity: ProbeIdentity, node: str, device: str, since: float
) -> Baseline:
    """The medians of the latest ok solo result of every other device with ``identity``
    (ended after ``since``), on any node of the archive.

    On PostgreSQL (a fleet's database) from the fleet's baselines (agent.archive.fleet_baselines:
    a row for the identity, and this device's own latest result), whose pass fixes the period:
    the results that ended between its ``since`` and its ``cutoff``; ``since`` here is unused."""
    if fleet_baselines.present(engine):
        return _baseline_by_key(engine, identity, node, device)
    return baseline_from_peers(engine, identity, node, device, since)


def baseline_from_peers(
    engine: Engine, identity: ProbeIdentity, node: str, device: str, since: float
) -> Baseline:
    """``baseline`` from the peers' own rows: a SQLite archive's way (one node), and the
    answer the fleet's baselines must give."""
    record = ProbeRunRecord
    matching = and_(
        *_results_of(identity),
        record.ended_at >= _at(since),
        ~and_(record.node == node, record.device == device),
    )
    last = (
        select(record.node, record.device, func.max(record.ended_at).label("last"))
        .where(matching)
        .group_by(record.node, record.device)
        .subquery()
    )
    statement = (
        select(record.steady_throughput, record.sustained_ratio)
        .join(
            last,
            and_(
                record.node == last.c.node,
                record.device == last.c.device,
                record.ended_at == last.c.last,
            ),
        )
        .where(matching)
    )
    with engine.connect() as connection:
        rows = connection.execute(statement).all()
    steady = [float(row[0]) for row in rows if row[0] is not None]
    ratios = [float(row[1]) for row in rows if row[1] is not None]
    return Baseline(
        steady=statistics.median(steady) if steady else None,
        ratio=statistics.median(ratios) if ratios else None,
        peers=len(rows),
    )


def _results_of(identity: ProbeIdentity) -> list[ColumnElement[bool]]:
    """The ok solo results with a steady value of ``identity``."""
    record = ProbeRunRecord
    return [
        record.outcome == "ok",
        record.scope == "device",
        record.steady_throughput.is_not(None),
        record.workload == identity.workload,
        record.precision == identity.precision,
        record.optimization == identity.optimization,
        func.coalesce(record.size, "default") == identity.size,
        record.device_model == identity.model,
        record.stack_id == identity.stack_id,
    ]


def _baseline_by_key(engine: Engine, identity: ProbeIdentity, node: str, device: str) -> Baseline:
    key = (
        identity.workload,
        identity.precision,
        identity.optimization,
        identity.size,
        identity.model,
        identity.stack_id,
    )
    group = fleet_baselines.groups(engine, fleet_baselines.HEALTH, [key]).get(key)
    if group is None:
        return Baseline(steady=None, ratio=None, peers=0)
    record = ProbeRunRecord
    since = group.since if group.since is not None else group.cutoff
    with engine.connect() as connection:
        own = connection.execute(
            select(record.steady_throughput, record.sustained_ratio)
            .where(
                record.node == node,
                record.device == device,
                *_results_of(identity),
                record.ended_at >= since,
                record.ended_at <= group.cutoff,
                record.id <= group.last_id,
            )
            .order_by(record.ended_at.desc(), record.id.desc())
            .limit(1)
        ).first()
    if own is None or own[0] is None:  # not among the pass's devices: every member is a peer
        return Baseline(group.steady.median(), group.ratio.median(), group.members)
    ratio = None if own[1] is None else float(own[1])
    return Baseline(
        steady=group.steady.median(float(own[0])),
        ratio=group.ratio.median(ratio) if ratio is not None else group.ratio.median(),
        peers=group.members - 1,
    )


def own_results(
    engine: Engine, node: str, runs: int, since: float
) -> dict[tuple[str, str, ProbeIdentity], list[OwnResult]]:
    """Each device's (key, label) latest ``runs`` ok solo results per identity, oldest first."""
    record = ProbeRunRecord
    statement = (
        select(
            record.device,
            record.device_label,
            record.workload,
            record.precision,
            record.optimization,
            record.size,
            record.device_model,
            record.stack_id,
            record.ended_at,
            record.steady_throughput,
            record.sustained_ratio,
            record.unit,
        )
        .where(
            record.node == node,
            record.outcome == "ok",
            record.scope == "device",
            record.steady_throughput.is_not(None),
            record.device_model.is_not(None),
            record.stack_id.is_not(None),
            record.ended_at >= _at(since),
        )
        .order_by(record.ended_at.desc())
    )
    found: dict[tuple[str, str, ProbeIdentity], list[OwnResult]] = {}
    with engine.connect() as connection:
        for row in connection.execute(statement):
            identity = ProbeIdentity(
                row.workload,
                row.precision,
                row.optimization,
                row.size or "default",
                row.device_model,
                row.stack_id,
            )
            results = found.setdefault((row.device, row.device_label, identity), [])
            if len(results) < runs and row.ended_at is not None:
                results.append(
                    OwnResult(
                        _time(row.ended_at),
                        row.steady_throughput,
                        row.sustained_ratio,
                        row.unit or "",
                    )
                )
    return {key: results[::-1] for key, results in found.items()}


def _events(engine: Engine, node: str, kinds: Sequence[str], since: float) -> list[EventRecord]:
    statement = (
        select(EventRecord)
        .where(
            EventRecord.node == node,
            EventRecord.kind.in_(kinds),
            EventRecord.occurred_at >= _at(since),
        )
        .order_by(EventRecord.occurred_at, EventRecord.id)
    )
    with Session(engine) as session:
        return list(session.scalars(statement))


def _attributes(event: EventRecord) -> dict[str, Any]:
    try:
        value = json.loads(event.attributes or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def clears(engine: Engine, node: str, since: float) -> list[Clear]:
    """The acknowledgements recorded for ``node`` since ``since``, oldest first."""
    found = []
    for event in _events(engine, node, (HEALTH_CLEAR,), since):
        attributes = _attributes(event)
        reasons = tuple(filter(None, str(attributes.get("reasons", "")).split(",")))
        found.append(
            Clear(
                event.event_id,
                event.device,
                _time(event.occurred_at),
                reasons,
                str(attributes.get("by", "")),
                str(attributes.get("why", "")),
            )
        )
    return found


def xids(engine: Engine, node: str, since: float) -> list[tuple[str, float, int]]:
    """The XID events of ``node`` since ``since``: (device UUID, time, XID)."""
    found = []
    for event in _events(engine, node, ("xid",), since):
        try:
            xid = int(_attributes(event).get("xid", ""))
        except ValueError:
            continue
        found.append((event.device, _time(event.occurred_at), xid))
    return found


# One field each collector rolls up every period: where the node's last rollup of it ends, the
# agent was still sampling (and would have recorded a change of verdict).
_ALIVE_FIELDS = {"host": "cpu_utilization", "gpu": "gpu_healthy"}


def _sampled_until(engine: Engine, node: str) -> dict[str, float]:
    """The end of the node's latest rollup of each ``_ALIVE_FIELDS`` field (an index lookup)."""
    rollup = TelemetryRollup
    found = {}
    with engine.connect() as connection:
        for kind, name in _ALIVE_FIELDS.items():
            row = connection.execute(
                select(rollup.period_start, rollup.period_seconds)
                .where(rollup.node == node, rollup.field == name)
                .order_by(rollup.period_start.desc())
                .limit(1)
            ).first()
            if row is not None:
                found[kind] = _time(row[0]) + float(row[1])
    return found


def recorded(engine: Engine, node: str) -> dict[str, Recorded]:
    """The last recorded verdict of each device of ``node``: the last one written (the
    archive's own sequence), not the latest ``occurred_at``, so a clock stepped back cannot
    bring an older verdict back. ``evidence_at`` is the later of its time and the end of the
    node's latest rollup of the device's collector: the agent sampled until then, and would
    have recorded a change (a device no longer sampled is recorded going unknown)."""
    record = EventRecord
    last = (
        select(func.max(record.id).label("last"))
        .where(record.node == node, record.kind == HEALTH_CHANGE)
        .group_by(record.device)
        .subquery()
    )
    statement = select(record).join(last, record.id == last.c.last).order_by(record.id)
    sampled = _sampled_until(engine, node)
    found: dict[str, Recorded] = {}
    with Session(engine) as session:
        for event in session.scalars(statement):
            attributes = _attributes(event)
            try:
                findings = json.loads(str(attributes.get("findings", "[]")))
            except ValueError:
                findings = []
            at = _time(event.occurred_at)
            alive = sampled.get("host" if event.device == "host" else "gpu", at)
            found[event.device] = Recorded(
                device=event.device,
                label=str(attributes.get("device", "")),
                uuid=str(attributes.get("uuid", "")),
                name=str(attributes.get("name", event.device)),
                at=at,
                state=str(attributes.get("state", "")),
                findings=tuple(item for item in findings if isinstance(item, dict)),
                evidence_at=max(at, alive),
            )
    return found


def last_states(engine: Engine, node: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The state and reasons of each device's last recorded verdict, by device key: a restarted
    agent that finds the same records no change (a restart is no news for the timeline)."""
    return {
        key: (r.state, tuple(str(f.get("reason", "")) for f in r.findings))
        for key, r in recorded(engine, node).items()
    }


def known_devices(engine: Engine, node: str) -> list[tuple[str, str, str, str]]:
    """Every device ``node`` has had a verdict for: (key, label, uuid, name), from its last
    recorded verdict."""
    return [(r.device, r.label, r.uuid, r.name) for r in recorded(engine, node).values() if r.label]


def below_baseline(
    identity: ProbeIdentity,
    own: Sequence[OwnResult],
    base: Baseline,
    *,
    threshold: float,
    runs: int,
    min_peers: int,
) -> Finding | None:
    """``below_fleet_baseline`` when the device's last ``runs`` results are all more than
    ``threshold`` under the peers' median steady throughput (or sustained ratio)."""
    if base.peers < min_peers or len(own) < runs:
        return None
    recent = own[-runs:]
    for what, median, values, unit in (
        ("steady throughput", base.steady, [r.steady for r in recent], f" {recent[-1].unit}"),
        ("sustained ratio", base.ratio, [r.ratio for r in recent], ""),
    ):
        if median is None or median <= 0:
            continue
        if all(value is not None and value < median * (1 - threshold) for value in values):
            last = values[-1]
            assert last is not None
            return Finding(
                "below_fleet_baseline",
                "degraded",
                f"{identity.name}: {what} {last:.4g}{unit.rstrip()} is {1 - last / median:.0%} "
                f"under the peers' median {median:.4g}{unit.rstrip()} ({base.peers} peers: "
                f"{identity.model}, same stack and size; {runs} runs in a row)",
                recent[-1].ended_at,
            )
    return None
