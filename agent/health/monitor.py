"""Each device's verdict, kept current from what the agent already knows.

``HealthMonitor`` is a sampler sink (every NVML and host sample re-evaluates its device, so the
verdict is at most one sampler period old), a probe listener (failed runs, results against the
fleet baseline) and the keeper of operators' acknowledgements. Every change of a device's state
or reasons becomes a ``health_change`` event with the evidence, for the archive.

A MIG device has its own probe findings and shares its GPU's hardware findings (an XID or a
pending row remap on the GPU is on every MIG device of it). The CPU is a device too (key "host").
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.archive.probe_runs import _size as archived_size
from agent.config.health_section import HealthSection
from agent.config.problems import one_line
from agent.health.records import (
    HEALTH_CHANGE,
    Baseline,
    Clear,
    OwnResult,
    ProbeIdentity,
    below_baseline,
)
from agent.health.rules import HELD, Finding, Readings, State, gpu_conditions, worst
from agent.probes.analysis import RunAnalysis
from agent.probes.node import Coupling
from agent.probes.runner import ProbeDevice, ProbeRun
from agent.probes.status import ProbeKey
from collectors.base import Event, Sample

log = logging.getLogger(__name__)

ECC_WINDOW_SECONDS = 3600.0
STALE_SECONDS = 120.0  # a device not sampled for this long (a MIG device removed) is dropped

# NVIDIA's XID catalogue (docs.nvidia.com/deploy/xid-errors): the ones that need a reset or mean
# the GPU is off the bus. Another XID a configuration lists is named by its number alone.
XID_MEANINGS = {
    48: "double-bit ECC error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

Baselines = Callable[[ProbeIdentity, str, float], Baseline]


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """One device's verdict: its state, the findings behind it, and those an operator
    acknowledged (still present, no longer counted)."""

    key: str  # the telemetry device: a GPU or MIG UUID, "host" for the CPU
    label: str
    uuid: str
    name: str
    state: State
    findings: tuple[Finding, ...]
    acknowledged: tuple[Finding, ...] = ()


@dataclass(eq=False)
class _Device:
    key: str
    label: str = ""
    uuid: str = ""
    name: str = ""
    parent: str | None = None
    seen: float = 0.0
    events: dict[str, Finding] = field(default_factory=dict)  # XIDs: stay until cleared
    conditions: dict[str, Finding] = field(default_factory=dict)  # hold while they hold
    episodes: dict[str, float] = field(default_factory=dict)  # condition -> since
    probe: dict[str, Finding] = field(default_factory=dict)  # probe_failures, node_coupling_low
    below: dict[ProbeIdentity, Finding] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    own: dict[ProbeIdentity, deque[OwnResult]] = field(default_factory=dict)
    ecc: deque[tuple[float, float]] = field(default_factory=deque)
    acknowledged: dict[str, float] = field(default_factory=dict)
    published: tuple[State, tuple[str, ...]] | None = None


def _name(label: str, mig: str | None) -> str:
    if label == "cpu":
        return "CPU"
    return f"GPU {label}" if mig is None else f"GPU {label} MIG {mig}"


class HealthMonitor:
    """The node's devices and their verdicts."""

    def __init__(
        self,
        settings: HealthSection,
        emit: Callable[[Event], None],
        *,
        baseline: Baselines | None = None,
        couplings: Callable[[], Mapping[ProbeKey, Coupling]] | None = None,
        clock: Callable[[], float] = time.time,
        cpu: bool = True,
    ) -> None:
        """``emit`` takes the health_change events; ``baseline`` answers the peers' medians
        (the archive); ``couplings`` the scheduler's latest coupling ratios."""
        self.settings = settings
        self._emit = emit
        self._baseline = baseline
        self._couplings = couplings
        self._clock = clock
        self._xids = frozenset(settings.unhealthy_xids)
        self._lock = threading.Lock()
        self._devices: dict[str, _Device] = {}
        self._baseline_failed = False
        if cpu:
            self._device("host", "cpu", "", None, None)

    # -- inputs --------------------------------------------------------------------------------

    def record(self, sample: Sample) -> None:
        """Sampler sink: re-evaluate the sample's device (and the devices its events name)."""
        now = self._clock()
        events: list[Event] = []
        with self._lock:
            touched: list[_Device] = []
            for event in sample.events:
                if event.kind == "xid":
                    touched.extend(self._xid(event))
            if sample.collector == "host":
                device = self._devices.get("host")
                if device is not None:
                    device.seen = now
                    touched.append(device)
            elif sample.collector == "nvml" and sample.readings and sample.device != "system":
                touched.extend(self._gpu_sample(sample, now))
            for device in dict.fromkeys(touched):
                events.extend(self._publish(device, now))
        for event in events:
            self._emit(event)

    def probe_run(self, run: ProbeRun, analysis: RunAnalysis | None, stack_id: str | None) -> None:
        """Probe listener: count failures, compare a result with the fleet baseline."""
        spec = run.spec
        if spec.device.key == "node":
            return
        if run.outcome == "ok" and analysis is not None and spec.scope == "device":
            self._compare(run, analysis, stack_id)  # the archive query runs outside the lock
        now = self._clock()
        with self._lock:
            device = self._probe_device(spec.device, now)
            limit = self.settings.probe_failures
            if run.outcome == "ok":
                device.failures.clear()
                device.probe.pop("probe_failures", None)
            elif run.outcome in {"failed", "timeout"}:
                device.failures.append(
                    f"{spec.name} {run.outcome}: {one_line(run.reason, limit=120)}"
                )
                del device.failures[:-limit]
                if len(device.failures) >= limit:
                    device.probe["probe_failures"] = Finding(
                        "probe_failures",
                        "unhealthy",
                        f"{len(device.failures)} probe runs in a row failed or timed out on the "
                        f"idle device; last: {device.failures[-1]}",
                        run.ended_at,
                    )
            events = self._publish(device, now)
        for event in events:
            self._emit(event)

    def acknowledge(self, clear: Clear) -> None:
        """An operator's ``sustain health clear``: the reasons it names no longer count until
        new evidence of them arrives."""
        now = self._clock()
        with self._lock:
            device = self._devices.get(clear.device) or next(
                (d for d in self._devices.values() if clear.device in {d.uuid, d.label} and d.uuid),
                None,
            )
            if device is None:
                return
            for reason in clear.reasons:
                device.acknowledged[reason] = max(device.acknowledged.get(reason, 0.0), clear.at)
            log.warning(
                "%s: %s acknowledged by %s: %s",
                device.name or device.key,
                ", ".join(clear.reasons) or "nothing",
                clear.by or "unknown",
                clear.why,
            )
            events = self._publish(device, now)
        for event in events:
            self._emit(event)

    def restore(
        self,
        xids: list[tuple[str, float, int]],
        own: Mapping[tuple[str, str, ProbeIdentity], list[OwnResult]],
    ) -> None:
        """What the archive holds since the node booted: XIDs (they stay until cleared or a
        reboot) and the devices' latest results (for the baseline's consecutive runs)."""
        with self._lock:
            for uuid, timestamp, xid in xids:
                self._xid(Event("xid", uuid, timestamp, "", (("xid", str(xid)),)))
            for (key, label, identity), results in own.items():
                device = self._devices.get(key) or self._device(key, label, "", None, None)
                device.own[identity] = deque(results, maxlen=self.settings.baseline_runs)

    # -- outputs -------------------------------------------------------------------------------

    def verdicts(self) -> list[DeviceHealth]:
        """Every device sampled lately, in device order."""
        now = self._clock()
        with self._lock:
            found = [
                self._verdict(device)
                for device in self._devices.values()
                if device.label and (device.key == "host" or now - device.seen <= STALE_SECONDS)
            ]
        return sorted(found, key=lambda d: (d.label == "cpu", _order(d.label), d.name))

    # -- the rules -----------------------------------------------------------------------------

    def _device(
        self, key: str, label: str, uuid: str, parent: str | None, mig: str | None
    ) -> _Device:
        device = self._devices.get(key)
        if device is None:
            device = self._devices[key] = _Device(key)
        if label and not device.label:
            device.label, device.uuid, device.parent = label, uuid, parent
            device.name = _name(label, mig)
        return device

    def _probe_device(self, probe: ProbeDevice, now: float) -> _Device:
        if probe.kind == "cpu":
            device = self._device(probe.key, "cpu", "", None, None)
        else:
            device = self._device(probe.key, probe.label, probe.key, probe.parent, probe.mig)
        device.seen = max(device.seen, now)
        return device

    def _xid(self, event: Event) -> list[_Device]:
        try:
            xid = int(dict(event.attributes).get("xid", ""))
        except ValueError:
            return []
        if xid not in self._xids:
            return []
        device = self._device(event.device, "", event.device, None, None)
        meaning = XID_MEANINGS.get(xid, "listed in health.unhealthy_xids")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(event.timestamp))
        previous = device.events.get(f"xid_{xid}")
        if previous is None or previous.since < event.timestamp:
            device.events[f"xid_{xid}"] = Finding(
                f"xid_{xid}", "unhealthy", f"XID {xid} ({meaning}) at {stamp} UTC", event.timestamp
            )
        return [device, *(d for d in self._devices.values() if d.parent == device.key)]

    def _gpu_sample(self, sample: Sample, now: float) -> list[_Device]:
        labels = dict(next(iter(sample.readings)).labels)
        if "device" not in labels or "uuid" not in labels:
            return []
        parent = labels.get("parent")
        device = self._device(
            sample.device, labels["device"], labels["uuid"], parent, labels.get("mig_instance")
        )
        device.seen = now
        if parent is not None:
            return [device]
        settings = self.settings
        readings = Readings(sample)
        conditions = gpu_conditions(
            readings,
            light_load=settings.light_load_utilization,
            active_load=settings.active_utilization,
            corrected_last_hour=self._corrected(device, readings, sample.timestamp),
            corrected_limit=settings.correctable_ecc_per_hour,
        )
        holding = {condition.reason for condition in conditions}
        for reason in list(device.episodes):
            if reason not in holding and reason != "node_coupling_low":
                del device.episodes[reason]
                device.conditions.pop(reason, None)
        for condition in conditions:
            since = device.episodes.setdefault(condition.reason, now)
            if condition.reason in HELD and now - since < settings.hold_seconds:
                continue
            device.conditions[condition.reason] = Finding(
                condition.reason, condition.state, condition.evidence, since
            )
        return [device, *(d for d in self._devices.values() if d.parent == device.key)]

    @staticmethod
    def _corrected(device: _Device, readings: Readings, timestamp: float) -> float | None:
        """Corrected ECC errors over the last hour (over the history there is, if shorter)."""
        total = readings.get("gpu_ecc_errors_total", type="corrected")
        if total is None:
            return None
        history = device.ecc
        if history and total < history[-1][1]:
            history.clear()  # the counter went back (a reset cleared the volatile counts)
        history.append((timestamp, total))
        while len(history) > 2 and history[1][0] <= timestamp - ECC_WINDOW_SECONDS:
            history.popleft()
        return total - history[0][1] if len(history) > 1 else None

    def _compare(self, run: ProbeRun, analysis: RunAnalysis, stack_id: str | None) -> None:
        spec = run.spec
        manifest = run.manifest or {}
        model = manifest.get("device_name")
        steady = analysis.figures.get("steady_throughput")
        if not model or not stack_id or not isinstance(steady, int | float):
            return
        identity = ProbeIdentity(
            spec.workload,
            spec.precision,
            spec.optimization,
            archived_size(spec, manifest.get("size")),
            str(model)[:128],
            stack_id,
        )
        ratio = analysis.figures.get("sustained_ratio")
        result = OwnResult(
            run.ended_at,
            float(steady),
            float(ratio) if isinstance(ratio, int | float) else None,
            str(manifest.get("unit", "")),
        )
        base = None
        if self._baseline is not None:
            since = self._clock() - self.settings.baseline_days * 86_400
            try:
                base = self._baseline(identity, spec.device.key, since)
                self._baseline_failed = False
            except Exception as exc:  # noqa: BLE001 - an archive fault costs this comparison
                if not self._baseline_failed:
                    log.warning("health: the fleet baseline cannot be read: %s", exc)
                self._baseline_failed = True
        with self._lock:
            device = self._probe_device(spec.device, self._clock())
            own = device.own.setdefault(identity, deque(maxlen=self.settings.baseline_runs))
            own.append(result)
            if base is None:
                return
            finding = below_baseline(
                identity,
                list(own),
                base,
                threshold=self.settings.baseline_threshold,
                runs=self.settings.baseline_runs,
                min_peers=self.settings.baseline_min_peers,
            )
            if finding is None:
                device.below.pop(identity, None)
            else:
                device.below[identity] = finding

    def _coupling(self, device: _Device, now: float) -> None:
        low = None
        if self._couplings is not None:
            for key, coupling in self._couplings().items():
                mine = key[4] == device.uuid if device.uuid else key[3] == device.label
                if mine and coupling.low_runs >= self.settings.coupling_low_runs:
                    low = (key, coupling)
        if low is None:
            device.episodes.pop("node_coupling_low", None)
            device.probe.pop("node_coupling_low", None)
            return
        (workload, precision, *_), coupling = low
        since = device.episodes.setdefault("node_coupling_low", now)
        device.probe["node_coupling_low"] = Finding(
            "node_coupling_low",
            "degraded",
            f"{workload} {precision} node-wide at {coupling.ratio:.0%} of solo for "
            f"{coupling.low_runs} runs in a row ({coupling.cause or 'cause unknown'})",
            since,
        )

    def _findings(self, device: _Device) -> list[Finding]:
        found = [*device.events.values(), *device.conditions.values(), *device.probe.values()]
        if device.below:
            found.append(max(device.below.values(), key=lambda finding: finding.since))
        parent = self._devices.get(device.parent) if device.parent else None
        if parent is not None:
            found += [
                Finding(f.reason, f.state, f"{parent.name}: {f.evidence}", f.since)
                for f in (*parent.events.values(), *parent.conditions.values())
            ]
        return found

    def _verdict(self, device: _Device) -> DeviceHealth:
        found = self._findings(device)
        active = tuple(f for f in found if device.acknowledged.get(f.reason, -math.inf) < f.since)
        acknowledged = tuple(f for f in found if f not in active)
        return DeviceHealth(
            device.key,
            device.label,
            device.uuid,
            device.name,
            worst(active),
            tuple(sorted(active, key=lambda f: f.reason)),
            tuple(sorted(acknowledged, key=lambda f: f.reason)),
        )

    def _publish(self, device: _Device, now: float) -> list[Event]:
        """The device's verdict; a health_change event when its state or reasons changed."""
        if not device.label:
            return []
        self._coupling(device, now)
        verdict = self._verdict(device)
        current = (verdict.state, tuple(f.reason for f in verdict.findings))
        if current == device.published:
            return []
        previous = "unknown" if device.published is None else device.published[0]
        device.published = current
        because = "; ".join(f"{f.reason}: {f.evidence}" for f in verdict.findings)
        log_level = logging.INFO if verdict.state == "healthy" else logging.WARNING
        log.log(log_level, "%s: %s -> %s%s", device.name, previous, verdict.state,
                f" ({because})" if because else "")  # fmt: skip
        return [
            Event(
                HEALTH_CHANGE,
                device.key,
                now,
                f"{device.name}: {previous} -> {verdict.state}"
                + (f" ({because})" if because else ""),
                (
                    ("state", verdict.state),
                    ("previous", previous),
                    ("reasons", ",".join(current[1])),
                    ("acknowledged", ",".join(f.reason for f in verdict.acknowledged)),
                    ("device", device.label),
                    ("uuid", device.uuid),
                    ("name", device.name),
                    ("findings", json.dumps([f.as_dict() for f in verdict.findings])),
                ),
            )
        ]


def _order(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (1 << 30, label)
