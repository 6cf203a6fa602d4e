"""Each device's verdict, kept current from what the agent already knows.

``HealthMonitor`` is a sampler sink (every NVML and host sample re-evaluates its device, so the
verdict is at most one sampler period old), a probe listener (failed runs, results against the
fleet baseline) and the keeper of operators' acknowledgements. Every change of a device's state
or reasons becomes a ``health_change`` event with the evidence, for the archive.

A MIG device has its own probe findings and shares its GPU's hardware findings (an XID or a
pending row remap on the GPU is on every MIG device of it). The CPU is a device too (key "host").

No device ever drops out of the verdicts while the node still has it: a GPU the agent knew (the
archive's verdicts, ``remember``) that is no longer sampled is ``unknown`` (``not_sampled``,
``sampler_stalled``), one NVML cannot identify is ``unknown`` (``unidentified``) or, answering
GPU_IS_LOST, ``unhealthy`` (``device_lost``). What concerns the node rather than one device (GPUs
missing, NVML failing on a node that had GPUs, a stalled sampler) is on the pseudo-device "node",
shown only while it has a reason (docs/health.md, "When the evidence is missing").
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
from agent.telemetry.sampler import LoopStatus
from collectors.base import Event, Sample

log = logging.getLogger(__name__)

ECC_WINDOW_SECONDS = 3600.0
NODE = "node"  # the pseudo-device of the node's own findings
SWEEP_SECONDS = 1.0  # how often the verdicts of devices no sample reaches are re-published

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
    evidence_at: float = 0.0  # when the device was last sampled (its evidence's time)


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
    missing: Finding | None = None  # NVML cannot identify it (device_lost or unidentified)


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
        loops: Callable[[], Sequence[LoopStatus]] | None = None,
        pci_gpus: Sequence[str] = (),
        known: Callable[[], Iterable[tuple[str, str, str, str]]] | None = None,
        recorded: Callable[[], Mapping[str, tuple[str, tuple[str, ...]]]] | None = None,
    ) -> None:
        """``emit`` takes the health_change events; ``baseline`` answers the peers' medians
        (the archive); ``couplings`` the scheduler's latest coupling ratios; ``loops`` the
        sampler loops' status (stalled, NVML absent or failing); ``pci_gpus`` the NVIDIA GPUs
        on the PCI bus (their addresses); ``known`` the devices the archive has verdicts for,
        and ``recorded`` their last recorded state and reasons, both read by ``restore``."""
        self.settings = settings
        self._emit = emit
        self._baseline = baseline
        self._couplings = couplings
        self._clock = clock
        self._xids = frozenset(settings.unhealthy_xids)
        self._lock = threading.Lock()
        self._devices: dict[str, _Device] = {}
        self._baseline_failed = False
        self._loops = loops
        self._known = known
        self._recorded = recorded
        self._last_recorded: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._pci_gpus = tuple(pci_gpus)
        self._swept = -math.inf
        self._started = clock()
        if cpu:
            self._device("host", "cpu", "", None, None).seen = self._started
        node = self._device(NODE, NODE, "", None, None)
        node.name = "node"

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
            if now - self._swept >= SWEEP_SECONDS or now < self._swept:
                self._swept = now  # devices no sample reaches go unknown, and say so once
                touched.extend(self._devices.values())
            for device in dict.fromkeys(touched):
                events.extend(self._publish(device, now))
        for event in events:
            self._emit(event)

    def remember(self, devices: Iterable[tuple[str, str, str, str]]) -> None:
        """GPUs the node had (key, label, uuid, name: the archive's verdicts): each keeps a
        verdict, unknown until it is sampled again, rather than vanish from the node."""
        with self._lock:
            for key, label, uuid, name in devices:
                if key in {"host", NODE} or not label or uuid.startswith("MIG-"):
                    continue
                device = self._device(key, label, uuid, None, None)
                device.name = device.name or name
                device.seen = max(device.seen, self._started)

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
        reboot) and the devices' latest results (for the baseline's consecutive runs); first the
        devices the node had (``known``), so that every one keeps a verdict."""
        if self._known is not None:
            try:
                self.remember(self._known())
            except Exception as exc:  # noqa: BLE001 - an archive fault costs the remembered set
                log.warning("health: cannot read the devices this node had: %s", exc)
        if self._recorded is not None:
            try:
                last = dict(self._recorded())
            except Exception as exc:  # noqa: BLE001 - a restart is then recorded as news
                log.warning("health: cannot read the verdicts last recorded: %s", exc)
                last = {}
            with self._lock:
                self._last_recorded = last
        with self._lock:
            for uuid, timestamp, xid in xids:
                self._xid(Event("xid", uuid, timestamp, "", (("xid", str(xid)),)))
            for (key, label, identity), results in own.items():
                device = self._devices.get(key) or self._device(key, label, "", None, None)
                device.own[identity] = deque(results, maxlen=self.settings.baseline_runs)

    # -- outputs -------------------------------------------------------------------------------

    def verdicts(self) -> list[DeviceHealth]:
        """Every device the node has, in device order; the node's own reasons last, if any."""
        now = self._clock()
        with self._lock:
            found = [
                self._verdict(device, now)
                for device in self._devices.values()
                if device.label and not self._gone(device, now)
            ]
        found = [v for v in found if v.key != NODE or v.findings or v.acknowledged]
        return sorted(
            found, key=lambda d: (d.key == NODE, d.label == "cpu", _order(d.label), d.name)
        )

    # -- the rules -----------------------------------------------------------------------------

    # -- the evidence's age -------------------------------------------------------------------

    def _fresh(self, device: _Device, now: float) -> bool:
        return now - device.seen <= self.settings.max_evidence_age_seconds

    def _gone(self, device: _Device, now: float) -> bool:
        """A device the node no longer has: a MIG device removed while its GPU is sampled, an
        index placeholder or a GPU whose index another GPU answers to now (a replaced GPU)."""
        if device.key in {"host", NODE} or self._fresh(device, now):
            return False
        if device.parent is not None:
            parent = self._devices.get(device.parent)
            return parent is None or self._fresh(parent, now)
        return any(
            other is not device
            and other.parent is None
            and other.label == device.label
            and other.uuid
            and self._fresh(other, now)
            for other in self._devices.values()
        )

    def _statuses(self) -> Sequence[LoopStatus]:
        return () if self._loops is None else self._loops()

    def _unsampled(self, device: _Device, now: float, stalled: set[str]) -> list[Finding]:
        """Unknown: what the agent cannot see of the device now."""
        collector = "host" if device.key == "host" else "nvml"
        if device.key == NODE:
            return []
        age = now - device.seen
        if collector in stalled:
            return [
                Finding(
                    "sampler_stalled",
                    "unknown",
                    f"the {collector} sampler is stalled (every call blocks); last sampled "
                    f"{age_text(age)} ago",
                    device.seen,
                )
            ]
        if age > self.settings.max_evidence_age_seconds and device.missing is None:
            return [
                Finding(
                    "not_sampled",
                    "unknown",
                    f"not sampled for {age_text(age)} (health.max_evidence_age_seconds = "
                    f"{self.settings.max_evidence_age_seconds:g})",
                    device.seen,
                )
            ]
        return []

    def _node_findings(self, now: float, statuses: Sequence[LoopStatus]) -> list[Finding]:
        """What concerns the node: a stalled sampler, NVML failing where GPUs were, GPUs
        missing against health.expected_gpus or the PCI bus."""
        found = []
        stalled = sorted(s.collector for s in statuses if s.stalled)
        if stalled:
            found.append(
                Finding(
                    "sampler_stalled",
                    "unknown",
                    f"sampler stalled: {', '.join(stalled)} (its calls block; the devices it "
                    "reads have no current verdict)",
                    now,
                )
            )
        nvml = next((s for s in statuses if s.collector == "nvml"), None)
        gpus = [
            d
            for d in self._devices.values()
            if d.parent is None and d.key not in {"host", NODE} and d.label
        ]
        expected = self.settings.expected_gpus
        had = sorted(
            filter(
                None,
                (
                    f"health.expected_gpus = {expected}" if expected else "",
                    f"{len(self._pci_gpus)} on the PCI bus" if self._pci_gpus else "",
                    f"{len(gpus)} known to the archive" if gpus else "",
                ),
            )
        )
        failing = nvml is not None and (nvml.absent is not None or (not nvml.up and nvml.polls))
        if nvml is not None and failing and had and nvml.collector not in stalled:
            why = nvml.absent or ", ".join(sorted(nvml.errors)) or "it fails"
            found.append(
                Finding(
                    "nvml_unavailable",
                    "unhealthy",
                    f"NVML does not answer ({why}) on a node that has GPUs ({'; '.join(had)})",
                    now,
                )
            )
        want = expected if expected is not None else len(self._pci_gpus)
        identified = sum(1 for d in gpus if d.uuid and d.missing is None and self._fresh(d, now))
        polled = nvml is not None and (nvml.polls > 0 or nvml.absent is not None)
        if want and identified < want and polled:
            source = (
                f"health.expected_gpus = {expected}"
                if expected is not None
                else f"{want} NVIDIA GPUs on the PCI bus ({', '.join(self._pci_gpus[:4])})"
            )
            found.append(
                Finding(
                    "gpus_missing",
                    "unhealthy",
                    f"NVML identifies {identified} of {want} GPUs ({source})",
                    now,
                )
            )
        return found

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
        if not labels["uuid"]:
            return [self._unidentified(labels["device"], sample, now)]
        self._devices.pop(_placeholder(labels["device"]), None)
        parent = labels.get("parent")
        device = self._device(
            sample.device, labels["device"], labels["uuid"], parent, labels.get("mig_instance")
        )
        device.seen = now
        device.missing = None
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

    def _unidentified(self, label: str, sample: Sample, now: float) -> _Device:
        """GPU ``label`` NVML lists but cannot identify (the collector asks again): the GPU the
        node had at that index, else a placeholder for it."""
        device = next(
            (
                d
                for d in self._devices.values()
                if d.label == label and d.parent is None and d.uuid and not self._fresh(d, now)
            ),
            None,
        ) or next(
            (d for d in self._devices.values() if d.label == label and d.parent is None and d.uuid),
            None,
        )
        if device is None:
            device = self._device(_placeholder(label), label, "", None, None)
        device.seen = now
        if "device_lost" in sample.errors:
            device.missing = Finding(
                "device_lost",
                "unhealthy",
                f"GPU {label} answers NVML_ERROR_GPU_IS_LOST: it cannot be identified",
                now if device.missing is None else device.missing.since,
            )
        else:
            device.missing = Finding(
                "unidentified",
                "unknown",
                f"NVML lists GPU {label} but cannot identify it ({', '.join(sample.errors)})",
                now if device.missing is None else device.missing.since,
            )
        return device

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

    def _findings(self, device: _Device, now: float) -> list[Finding]:
        statuses = self._statuses()
        if device.key == NODE:
            return self._node_findings(now, statuses)
        stalled = {s.collector for s in statuses if s.stalled}
        found = [*device.events.values(), *device.conditions.values(), *device.probe.values()]
        found += self._unsampled(device, now, stalled)
        if device.missing is not None:
            found.append(device.missing)
        if device.below:
            found.append(max(device.below.values(), key=lambda finding: finding.since))
        parent = self._devices.get(device.parent) if device.parent else None
        if parent is not None:
            found += [
                Finding(f.reason, f.state, f"{parent.name}: {f.evidence}", f.since)
                for f in (*parent.events.values(), *parent.conditions.values())
            ]
        return found

    def _verdict(self, device: _Device, now: float) -> DeviceHealth:
        found = self._findings(device, now)
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
            now if device.key == NODE else device.seen,
        )

    def _publish(self, device: _Device, now: float) -> list[Event]:
        """The device's verdict; a health_change event when its state or reasons changed."""
        if not device.label or self._gone(device, now):
            return []
        if device.key != NODE:
            self._coupling(device, now)
        verdict = self._verdict(device, now)
        current = (verdict.state, tuple(f.reason for f in verdict.findings))
        if current == device.published:
            return []
        if device.published is None and (
            (device.key == NODE and not verdict.findings)  # recorded once it has news
            or self._last_recorded.get(device.key) == current  # as recorded before a restart
        ):
            device.published = current
            return []
        before = device.published or self._last_recorded.get(device.key)  # as last recorded
        previous = "unknown" if before is None else before[0]
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


def pci_gpus(sysfs: Path) -> tuple[str, ...]:
    """The NVIDIA GPUs on the PCI bus (vendor 0x10de, class display or 3D controller): what the
    node has whether or not NVML answers."""
    found = []
    for device in sorted((sysfs / "bus" / "pci" / "devices").glob("*")):
        try:
            vendor = (device / "vendor").read_text().strip()
            kind = (device / "class").read_text().strip()
        except OSError:
            continue
        if vendor.lower() == "0x10de" and kind.lower().startswith(("0x0300", "0x0302")):
            found.append(device.name)
    return tuple(found)


def _placeholder(label: str) -> str:
    """The key of a GPU NVML lists at index ``label`` but cannot identify."""
    return f"gpu-index-{label}"


def age_text(seconds: float) -> str:
    """An age in words: 45 s, 12 min, 3.5 h, 30 d."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86_400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _order(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (1 << 30, label)
