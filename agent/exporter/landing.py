"""The landing page at /: what an operator who opens the agent in a browser wants to know first.

The node, its collectors (up, down, or absent and why), each device with its health verdict and
the reasons behind it, and the latest probe run of each device: its own outcome and figures (its
throughput, on a steady or a p10 basis, its sustained ratio and classification), or that it gave
none and why, never the figures of an older run beside its time; then links to /metrics, /healthz
and the documentation. Everything comes from
status objects the agent already keeps in memory (no archive query), so the page costs about what
a /healthz does. Plain HTML: every value is escaped, no script, no style sheet or font from
elsewhere (a strict Content-Security-Policy goes with it).
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent import __version__
from agent.health.monitor import DeviceHealth
from agent.probes.status import LatestRun, ProbeKey, ProbeStatus
from agent.reports.capacity_output import human
from agent.telemetry.sampler import LoopStatus
from collectors.base import Sample

# The documents an operator looks up from here, under exporter.docs_url.
DOCUMENTS = (
    ("metrics.md", "metrics"),
    ("health.md", "health verdicts and their reasons"),
    ("alerts.md", "alerts and runbooks"),
    ("probe.md", "probes and steady state"),
)
# Why a collector is absent, in words (reasons of sustain_collector_absent, docs/metrics.md).
ABSENT_REASONS = {
    "library_not_found": "no libnvidia-ml.so.1 here: no NVIDIA driver installed",
    "driver_not_loaded": "the NVIDIA kernel driver is not loaded",
}
CONTENT_SECURITY_POLICY = "default-src 'none'; style-src 'unsafe-inline'"
STYLE = (
    "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1em}"
    "td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}"
    ".healthy,.up{color:#080}.degraded,.absent,.unknown{color:#a60}.unhealthy,.down{color:#c00}"
)


@dataclass(frozen=True, slots=True)
class LandingSources:
    """Where the page's figures come from: callables into the running agent's rooms."""

    node: str
    loops: Callable[[], Sequence[LoopStatus]]
    health: Callable[[], Sequence[DeviceHealth]] | None = None
    probes: Callable[[], ProbeStatus] | None = None
    docs_url: str = ""
    telemetry: Callable[[], Sequence[Sample]] | None = None  # the latest poll of each device


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _age(timestamp: float | None, now: float) -> str:
    if timestamp is None:
        return "never"
    seconds = max(0.0, now - timestamp)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _collectors(loops: Sequence[LoopStatus], now: float) -> str:
    rows = []
    for status in loops:
        state = "absent" if status.absent else "up" if status.up else "down"
        notes = []
        if status.absent:
            why = ABSENT_REASONS.get(status.absent)
            notes.append(status.absent if why is None else f"{status.absent}: {why}")
        if status.stalled:
            notes.append("sampler loop stalled")
        notes.extend(f"{kind} errors: {count}" for kind, count in sorted(status.errors.items()))
        rows.append(
            f"<tr><td>{_e(status.collector)}</td><td class={state}>{state}</td>"
            f"<td>{status.interval_seconds:g} s</td>"
            f"<td>{_e(_age(status.last_poll_timestamp, now))}</td>"
            f"<td>{_e('; '.join(notes))}</td></tr>"
        )
    if not rows:
        return "<p>No collector is enabled.</p>"
    return (
        "<table><tr><th>collector</th><th>state</th><th>interval</th><th>last poll</th>"
        f"<th>why</th></tr>{''.join(rows)}</table>"
    )


def _latest_probes(status: ProbeStatus) -> dict[str, tuple[ProbeKey, LatestRun]]:
    """Each device's most recent probe run (solo, not skipped), by device label."""
    latest: dict[str, tuple[ProbeKey, LatestRun]] = {}
    for key, run in status.latest.items():
        device = key[3]
        held = latest.get(device)
        if held is None or run.ended_at > held[1].ended_at:
            latest[device] = (key, run)
    return latest


def _outcome(run: LatestRun) -> str:
    """The run's outcome in words: ``ok``, or why it gave no figures (``timeout after 60 s, no
    figures: ...``)."""
    if run.result is not None:
        return run.outcome
    seconds = max(0.0, run.ended_at - run.started_at)
    after = f" after {seconds:.0f} s" if run.outcome != "unsupported" else ""
    why = run.reason or ("not analysed" if run.outcome == "ok" else "")
    return f"{run.outcome}{after}, no figures" + (f": {why}" if why else "")


def _throughput(run: LatestRun) -> str:
    """The figure a planner would use, with its basis: the steady value, else the p10 over
    one-second windows of a run that never settled."""
    if run.result is None:
        return ""
    figures, unit = run.result.analysis.figures, run.result.unit
    steady, p10 = figures.get("steady_throughput"), figures.get("p10_throughput")
    if isinstance(steady, int | float):
        return f"{human(float(steady), unit)} steady"
    if isinstance(p10, int | float) and figures.get("classification") == "no_steady_state":
        return f"{human(float(p10), unit)} p10 (no steady state)"
    return "none"


def _probe_cells(entry: tuple[ProbeKey, LatestRun] | None, now: float) -> str:
    if entry is None:
        return "<td colspan=6>no probe run yet</td>"
    key, run = entry
    ratio, classification = None, ""
    if run.result is not None:
        figures = run.result.analysis.figures
        ratio = figures.get("sustained_ratio")
        cause = run.result.analysis.attribution.cause
        classification = str(figures.get("classification") or "")
        if cause:
            classification += f" ({cause})"
    return (
        f"<td>{_e(' '.join(key[:3]))}</td><td>{_e(_age(run.ended_at, now))}</td>"
        f"<td>{_e(_outcome(run))}</td><td>{_e(_throughput(run))}</td>"
        f"<td>{'' if ratio is None else f'{float(ratio):.3f}'}</td><td>{_e(classification)}</td>"
    )


def _models(samples: Sequence[Sample]) -> dict[str, str]:
    """GPU UUID -> model name, from the latest gpu_info readings."""
    models = {}
    for sample in samples:
        for reading in sample.readings:
            if reading.field == "gpu_info":
                labels = dict(reading.labels)
                models[labels.get("uuid", "")] = labels.get("name", "")
    return models


def _findings(device: DeviceHealth) -> str:
    items = [f"<li>{_e(f.reason)}: {_e(f.evidence)}</li>" for f in device.findings]
    items += [
        f"<li>{_e(f.reason)} (acknowledged): {_e(f.evidence)}</li>" for f in device.acknowledged
    ]
    return f"<ul>{''.join(items)}</ul>" if items else ""


def _devices(sources: LandingSources, now: float) -> str:
    verdicts = list(sources.health()) if sources.health is not None else []
    status = sources.probes() if sources.probes is not None else None
    latest = _latest_probes(status) if status is not None else {}
    models = _models(sources.telemetry()) if sources.telemetry is not None else {}
    rows = []
    for device in verdicts:
        entry = latest.pop(device.label, None)
        probe = "" if status is None else _probe_cells(entry, now)
        name = models.get(device.uuid) or device.name
        rows.append(
            f"<tr><td>{_e(device.label)}</td><td>{_e(name)}</td><td>{_e(device.uuid)}</td>"
            f"<td class={_e(device.state)}>{_e(device.state)}{_findings(device)}</td>{probe}</tr>"
        )
    for label, entry in sorted(latest.items()):  # probed devices the monitor does not list
        rows.append(
            f"<tr><td>{_e(label)}</td><td>{_e(models.get(entry[0][4], ''))}</td>"
            f"<td>{_e(entry[0][4])}</td>"
            f"<td>{'' if sources.health is None else 'not sampled'}</td>"
            f"{_probe_cells(entry, now)}</tr>"
        )
    health_off = (
        "<p>Health verdicts are off (health.enabled).</p>" if sources.health is None else ""
    )
    if not rows:
        return f"{health_off}<p>No device reported yet.</p>"
    head = "<th>device</th><th>name</th><th>uuid</th><th>health</th>"
    if status is not None:
        head += (
            "<th>last probe</th><th>ran</th><th>outcome</th><th>throughput</th>"
            "<th>sustained ratio</th><th>classification</th>"
        )
    return f"{health_off}<table><tr>{head}</tr>{''.join(rows)}</table>"


def _links(docs_url: str) -> str:
    links = '<a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a>'
    base = docs_url.rstrip("/")
    if base:
        docs = " &middot; ".join(
            f'<a href="{_e(f"{base}/{name}")}">{_e(title)}</a>' for name, title in DOCUMENTS
        )
    else:
        docs = ", ".join(f"docs/{_e(name)}" for name, _ in DOCUMENTS) + (
            " in sustain's source (set exporter.docs_url to link them)"
        )
    return f"<p>{links}</p><p>Documentation: {docs}</p>"


def render(sources: LandingSources, now: float | None = None) -> bytes:
    now = time.time() if now is None else now
    node = _e(sources.node)
    page = (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>sustain on {node}</title><style>{STYLE}</style></head><body>"
        f"<h1>sustain {_e(__version__)} on {node}</h1>"
        "<p>Sustained-throughput agent.</p>"
        f"{_links(sources.docs_url)}"
        f"<h2>Collectors</h2>{_collectors(sources.loops(), now)}"
        f"<h2>Devices</h2>{_devices(sources, now)}"
        "</body></html>"
    )
    return page.encode()
