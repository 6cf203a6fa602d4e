"""``sustain health``: the node's verdict now, and ``sustain health clear``.

The verdict comes from the running agent's /metrics when it answers (live), else from the
archive: the last verdict the agent recorded for each device, the acknowledgements since, and the
fleet baseline recomputed from the probe results; an archived verdict whose evidence is older than
``health.max_evidence_age_seconds`` is unknown (``stale_evidence``). Exit codes follow
node-problem-detector's custom plugins: 0 every device healthy, 1 a device degraded or unhealthy,
2 unknown (no verdict to be had, evidence missing or too old) or bad input. The first line of the
text output is a summary short enough for a node condition's message (``--max-length``);
``--summary`` prints it alone.
"""

from __future__ import annotations

import getpass
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agent.config.problems import one_line
from agent.config.settings import Settings
from agent.health import records
from agent.health.monitor import age_text
from agent.health.rules import SEVERITY, Finding, state_of, worst

EXIT_HEALTHY = 0
EXIT_PROBLEM = 1
EXIT_UNKNOWN = 2
LIVE_TIMEOUT_SECONDS = 3.0
MAX_METRICS_BYTES = 32 << 20


class HealthError(Exception):
    """Bad input or an unusable archive: one line, exit code 2."""


@dataclass
class Verdict:
    key: str  # a GPU or MIG UUID, "host" for the CPU
    label: str
    uuid: str
    name: str
    findings: list[Finding] = field(default_factory=list)
    acknowledged: list[Finding] = field(default_factory=list)
    state: str = "healthy"
    evidence_at: float | None = None  # an archived verdict's evidence time; None: live

    def settle(self) -> None:
        self.findings.sort(key=lambda f: f.reason)
        self.state = worst(self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.label,
            "uuid": self.uuid,
            "name": self.name,
            "state": self.state,
            "reasons": [f.as_dict() for f in self.findings],
            "acknowledged": [f.as_dict() for f in self.acknowledged],
            "evidence_at": None if self.evidence_at is None else round(self.evidence_at, 3),
        }


@dataclass
class NodeHealth:
    node: str
    source: str  # "live" or "archive"
    where: str
    devices: list[Verdict]
    note: str = ""
    checked_at: float = field(default_factory=time.time)

    @property
    def state(self) -> str:
        if not self.devices:
            return "unknown"
        return max((d.state for d in self.devices), key=SEVERITY.__getitem__)

    @property
    def evidence_age(self) -> float | None:
        """Seconds since the oldest archived evidence; None for a live verdict."""
        times = [d.evidence_at for d in self.devices if d.evidence_at is not None]
        return self.checked_at - min(times) if times else None


def _name(label: str, uuid: str) -> str:
    if label in {"cpu", "node"}:
        return "CPU" if label == "cpu" else "node"
    if not label:
        return "CPU"
    return f"GPU {label} MIG" if uuid.startswith("MIG-") else f"GPU {label}"


def _metrics_url(settings: Settings) -> str:
    host, port = settings.listen_address
    if host in {"", "0.0.0.0"}:  # noqa: S104 - the agent listens everywhere: ask locally
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def live(
    url: str, authorization: str | None = None, context: ssl.SSLContext | None = None
) -> list[Verdict] | str:
    """The verdicts the agent exports at ``url``; a one-line reason where it does not answer.
    ``authorization``: the header for an agent behind basic auth (``--user``)."""
    request = urllib.request.Request(url)  # noqa: S310 - the operator's --metrics URL
    if authorization is not None:
        request.add_unredirected_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(  # noqa: S310
            request, timeout=LIVE_TIMEOUT_SECONDS, context=context
        ) as response:
            text = response.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return f"the agent answered HTTP {exc.code} at {url}{_auth_hint(exc.code, authorization)}"
    except (OSError, ValueError) as exc:
        return f"the agent does not answer at {url} ({one_line(str(exc), limit=80)})"
    devices: dict[tuple[str, str], Verdict] = {}
    seen = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        return f"unreadable exposition at {url} ({one_line(str(exc), limit=80)})"
    for family in families:
        for sample in family.samples:
            if not sample.name.startswith("sustain_device_health"):
                continue
            labels = sample.labels
            key = (labels.get("device", ""), labels.get("uuid", ""))
            verdict = devices.setdefault(
                key, Verdict(key[1] or "host", key[0], key[1], _name(*key))
            )
            if sample.name == "sustain_device_health":
                seen = True
            elif sample.name == "sustain_device_health_reason" and sample.value == 1:
                reason = labels["reason"]
                verdict.findings.append(Finding(reason, state_of(reason), "", 0.0))
            elif sample.name == "sustain_device_health_acknowledged" and sample.value == 1:
                reason = labels["reason"]
                verdict.acknowledged.append(Finding(reason, state_of(reason), "", 0.0))
            if sample.name == "sustain_device_health" and sample.value == 1:
                verdict.state = labels.get("state", "healthy")
    if not seen:
        return f"the agent at {url} exports no sustain_device_health (health.enabled = false?)"
    return list(devices.values())


def _auth_hint(code: int, authorization: str | None) -> str:
    if code != 401:
        return ""
    if authorization is None:
        return " (it wants basic auth: --user, docs/security.md)"
    return " (the --user and password were refused)"


def _archived(engine: Any, settings: Settings) -> list[Verdict]:
    """The last recorded verdicts, less what was acknowledged since, plus the fleet baseline."""
    node = settings.agent.node
    health = settings.health
    verdicts: dict[str, Verdict] = {}
    now = time.time()
    for key, recorded in records.recorded(engine, node).items():
        verdict = Verdict(key, recorded.label, recorded.uuid, recorded.name or key)
        verdict.findings = [Finding.from_dict(item) for item in recorded.findings]
        verdict.evidence_at = recorded.evidence_at
        verdicts[key] = verdict
    own = records.own_results(engine, node, health.baseline_runs, now - 365 * 86_400)
    for (key, label, identity), results in own.items():
        base = records.baseline(engine, identity, node, key, now - health.baseline_days * 86_400)
        finding = records.below_baseline(
            identity,
            results,
            base,
            threshold=health.baseline_threshold,
            runs=health.baseline_runs,
            min_peers=health.baseline_min_peers,
        )
        uuid = "" if key == "host" else key
        verdict = verdicts.setdefault(key, Verdict(key, label, uuid, _name(label, uuid)))
        if finding is not None and all(f.reason != finding.reason for f in verdict.findings):
            verdict.findings.append(finding)
    clears = records.clears(engine, node, 0.0)
    for verdict in verdicts.values():
        for clear in clears:
            if clear.device != verdict.key:
                continue
            covered = [
                f for f in verdict.findings if f.reason in clear.reasons and f.since <= clear.at
            ]
            verdict.acknowledged += covered
            verdict.findings = [f for f in verdict.findings if f not in covered]
    limit = health.max_evidence_age_seconds
    for verdict in verdicts.values():
        age = now - (verdict.evidence_at if verdict.evidence_at is not None else now)
        # A clock stepped back by more than the limit leaves the age unknowable: stale too.
        if abs(age) > limit:
            verdict.findings.append(
                Finding(
                    "stale_evidence",
                    "unknown",
                    f"the archived verdict's evidence is {age_text(age)} old (more than "
                    f"health.max_evidence_age_seconds = {limit:g})"
                    if age > 0
                    else "the archived verdict is dated in the future (the clock stepped back)",
                    verdict.evidence_at or now,
                )
            )
        verdict.settle()
    return [v for v in verdicts.values() if v.key != "node" or v.findings or v.acknowledged]


def _with_evidence(verdicts: Iterable[Verdict], archived: Sequence[Verdict]) -> None:
    """Live verdicts carry reasons only: their evidence is in the archive's last record."""
    known = {(v.key, f.reason): f for v in archived for f in (*v.findings, *v.acknowledged)}
    for verdict in verdicts:
        for findings in (verdict.findings, verdict.acknowledged):
            for position, finding in enumerate(findings):
                findings[position] = known.get((verdict.key, finding.reason), finding)


def node_health(
    settings: Settings,
    open_engine: Callable[[], Any],
    *,
    metrics: str | None,
    use_live: bool,
    authorization: str | None = None,
    context: ssl.SSLContext | None = None,
) -> NodeHealth:
    """The node's verdict: live where the agent answers, else from the archive."""
    node = settings.agent.node
    url = metrics or _metrics_url(settings)
    found: list[Verdict] | str = (
        live(url, authorization, context) if use_live else "not asked (--no-live)"
    )
    engine = None
    archived: list[Verdict] = []
    archive_problem = ""
    try:
        engine = open_engine()
        archived = _archived(engine, settings)
    except HealthError as exc:
        archive_problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - a database fault: the live verdict may stand alone
        archive_problem = f"the archive cannot be read: {one_line(str(exc), limit=120)}"
    finally:
        if engine is not None:
            engine.dispose()
    if isinstance(found, list):
        _with_evidence(found, archived)
        return NodeHealth(node, "live", url, _ordered(found), archive_problem)
    note = found if not archive_problem else f"{found}; {archive_problem}"
    return NodeHealth(node, "archive", "", _ordered(archived), note)


def _ordered(verdicts: list[Verdict]) -> list[Verdict]:
    def order(verdict: Verdict) -> tuple[int, int, str]:
        label = verdict.label
        return (
            {"cpu": 1, "node": 2}.get(label, 0),
            int(label) if label.isdigit() else 0,
            verdict.uuid,
        )

    return sorted(verdicts, key=order)


def summary(health: NodeHealth, limit: int) -> str:
    """One line within ``limit`` characters: the worst states first, with their devices and
    reasons; shortened (reasons, then device names) rather than cut where it can be. A verdict
    from the archive ends with where it is from and how old its evidence is."""
    if not health.devices:
        return _cut(f"unknown: {health.note or 'no verdict'}", limit)
    age = health.evidence_age
    if health.source != "archive":
        return _summary(health, limit)
    suffix = f" (archive, {age_text(age or 0.0)} old)"
    return _summary(health, max(1, limit - len(suffix.encode()))) + suffix


def _summary(health: NodeHealth, limit: int) -> str:
    groups = [
        (state, [d for d in health.devices if d.state == state])
        for state in ("unhealthy", "degraded", "unknown")
    ]
    groups = [(state, devices) for state, devices in groups if devices]
    if not groups:
        names = ", ".join(d.name for d in health.devices)
        for text in (f"healthy: {names}", f"healthy: {len(health.devices)} devices"):
            if _fits(text, limit):
                return text
        return _cut("healthy", limit)

    def named(device: Verdict, state: str) -> str:
        reasons = " ".join(f.reason for f in device.findings if f.state == state)
        return f"{device.name} {reasons}".rstrip()

    candidates = [
        "; ".join(
            f"{state}: "
            + ", ".join(f"{d.name} {' '.join(f.reason for f in d.findings)}" for d in devices)
            for state, devices in groups
        ),
        "; ".join(
            f"{state}: " + ", ".join(named(d, state) for d in devices) for state, devices in groups
        ),
        "; ".join(
            f"{state}: "
            + ", ".join(named(d, state) if state == "unhealthy" else d.name for d in devices)
            for state, devices in groups
        ),
        "; ".join(f"{state}: " + ", ".join(d.name for d in devices) for state, devices in groups),
        "; ".join(f"{state}: {len(devices)} device(s)" for state, devices in groups),
    ]
    for text in candidates[:-1]:
        if _fits(text, limit):
            return text
    # The worst devices by name and reason, as many as fit; the rest counted.
    worst_state, worst_devices = groups[0]
    rest = "".join(f"; {state}: {len(devices)} device(s)" for state, devices in groups[1:])
    named_devices = [named(d, worst_state) for d in worst_devices]
    for shown in range(len(named_devices) - 1, 0, -1):
        more = len(named_devices) - shown
        text = f"{worst_state}: {', '.join(named_devices[:shown])} +{more} more{rest}"
        if _fits(text, limit):
            return text
    return _cut(candidates[-1], limit)


def _fits(text: str, limit: int) -> bool:
    """node-problem-detector cuts its plugins' output by bytes, not characters."""
    return len(text.encode()) <= limit


def _cut(text: str, limit: int) -> str:
    if _fits(text, limit):
        return text
    return text.encode()[: max(0, limit - 3)].decode(errors="ignore") + "..."


def render(health: NodeHealth, limit: int) -> str:
    lines = [summary(health, limit)]
    for device in health.devices:
        because = "; ".join(
            f"{f.reason}: {f.evidence}" if f.evidence else f.reason for f in device.findings
        )
        line = f"{device.name:<14} {device.uuid or '-':<42} {device.state:<9}"
        lines.append(f"{line} {because}".rstrip())
        for finding in device.acknowledged:
            lines.append(f"{'':<14} {'':<42} {'':<9} acknowledged: {finding.reason}")
    if health.source == "live":
        lines.append(f"(live from {health.where})")
    else:
        age = health.evidence_age
        old = "" if age is None else f", evidence {age_text(age)} old"
        lines.append(f"(from the archive of node {health.node}{old}: {health.note})")
    return "\n".join(lines)


def as_json(health: NodeHealth, limit: int) -> str:
    age = health.evidence_age
    return json.dumps(
        {
            "node": health.node,
            "source": health.source,
            "state": health.state,
            "summary": summary(health, limit),
            "note": health.note,
            "evidence_age_seconds": None if age is None else round(age, 3),
            "devices": [d.as_dict() for d in health.devices],
        },
        indent=2,
    )


def exit_code(health: NodeHealth) -> int:
    state = health.state
    if state == "unknown":
        return EXIT_UNKNOWN
    return EXIT_HEALTHY if state == "healthy" else EXIT_PROBLEM


def _match(devices: Sequence[Verdict], wanted: str) -> Verdict:
    text = wanted.strip()
    lowered = text.lower()
    exact = [d for d in devices if text and text in {d.uuid, d.key}]
    if exact:
        return exact[0]
    found = [
        d
        for d in devices
        if lowered in {d.label.lower(), d.name.lower()} or (lowered == "cpu" and d.key == "host")
    ]
    known = ", ".join(d.label if not d.uuid.startswith("MIG-") else d.uuid for d in devices)
    if not found:
        raise HealthError(
            f"no device {one_line(text, limit=60)!r} on this node (devices: {known or 'none'})"
        )
    if len(found) > 1:
        raise HealthError(
            f"device {one_line(text, limit=60)!r} is ambiguous: "
            + ", ".join(f"{d.name} {d.uuid}" for d in found)
            + " (give the UUID)"
        )
    return found[0]


def clear(
    health: NodeHealth, writer: Callable[[], Any], wanted: str, why: str, by: str | None
) -> tuple[str, int]:
    """Record an acknowledgement of the device's current reasons; (message, exit code).
    ``writer`` opens the archive's event writer, once the device is known to need one."""
    from collectors.base import Event

    reason = why.strip()
    if not reason or not reason.isprintable():
        raise HealthError("--reason must say why, in printable text")
    device = _match(health.devices, wanted)
    if not device.findings:
        return f"{device.name} is {device.state}: nothing to clear", EXIT_HEALTHY
    who = (by or os.environ.get("SUDO_USER") or _user()).strip() or "unknown"
    reasons = [f.reason for f in device.findings]
    event = Event(
        records.HEALTH_CLEAR,
        device.key,
        time.time(),
        f"{device.name}: {', '.join(reasons)} acknowledged by {who}: {reason}",
        (
            ("by", who[:120]),
            ("why", reason[:500]),
            ("reasons", ",".join(reasons)),
            ("state", device.state),
            ("device", device.label),
            ("uuid", device.uuid),
        ),
    )
    writer().write([event])
    return (
        f"{device.name}: {', '.join(reasons)} acknowledged by {who}; new evidence of them "
        "shows again",
        EXIT_HEALTHY,
    )


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""
