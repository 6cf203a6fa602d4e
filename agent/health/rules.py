"""The rules: what a device's readings say about its health, each as a ``Finding``.

A finding names its reason (a label value, stable: dashboards, alerts and node-problem-detector
messages key on it), the state it implies, the evidence in words and ``since``: the time of the
evidence (an XID's time, the start of a condition's episode, the last failed probe run). An
operator's acknowledgement covers the findings whose evidence is no newer than it, so new evidence
always shows again (docs/health.md, "Clearing a state").

The readings rules here work on one NVML sample of one GPU, with what the monitor remembers of
the device (how long each condition has held, the corrected-ECC history); the probe rules are in
``agent.health.monitor``, the fleet baseline in ``agent.health.records``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from collectors.base import Sample

State = Literal["healthy", "unknown", "degraded", "unhealthy"]
STATES: tuple[State, ...] = ("healthy", "degraded", "unhealthy", "unknown")
# Unknown ranks above healthy (no evidence is no proof of health) and below the states that
# evidence shows: a node with one unknown and one unhealthy device is unhealthy.
SEVERITY: Mapping[str, int] = {"healthy": 0, "unknown": 1, "degraded": 2, "unhealthy": 3}

# Clock-event reasons that, at light load, are a cooling or power-delivery fault, not the load's
# doing (NVML, nvmlClocksEventReasons: "HW Slowdown ... temperature being too high, External
# Power Brake Assertion is triggered ...").
THERMAL = ("sw_thermal_slowdown", "hw_thermal_slowdown")
POWER_BRAKE = ("hw_power_brake_slowdown", "hw_slowdown")
# Conditions that count only once they have held for health.hold_seconds.
HELD = frozenset(
    {"thermal_while_idle", "power_brake_while_idle", "pcie_link_degraded",
     "applications_clocks_below_max"}
)  # fmt: skip

UNHEALTHY_REASONS = frozenset(
    {
        "device_lost",
        "row_remap_failed",
        "row_remap_pending",
        "probe_failures",
        "gpus_missing",
        "nvml_unavailable",
    }
)
# No evidence either way (docs/health.md, "When the evidence is missing").
UNKNOWN_REASONS = frozenset({"not_sampled", "unidentified", "sampler_stalled", "stale_evidence"})


def state_of(reason: str) -> State:
    """The state a reason implies (an XID listed as unhealthy: ``xid_N``)."""
    if reason in UNKNOWN_REASONS:
        return "unknown"
    return "unhealthy" if reason in UNHEALTHY_REASONS or reason.startswith("xid_") else "degraded"


ID_LABELS = frozenset({"device", "uuid", "parent", "mig_instance"})


@dataclass(frozen=True, slots=True)
class Finding:
    """One reason a device is not healthy."""

    reason: str
    state: State
    evidence: str
    since: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "state": self.state,
            "evidence": self.evidence,
            "since": round(self.since, 3),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        state = str(data.get("state", "degraded"))
        return cls(
            reason=str(data["reason"]),
            state=state if state in STATES else "degraded",
            evidence=str(data.get("evidence", "")),
            since=float(data.get("since", 0.0)),
        )


def worst(findings: Iterable[Finding]) -> State:
    state: State = "healthy"
    for finding in findings:
        if SEVERITY[finding.state] > SEVERITY[state]:
            state = finding.state
    return state


class Readings:
    """One sample's readings by field key and the labels that are not the device's identity."""

    __slots__ = ("_values",)

    def __init__(self, sample: Sample) -> None:
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for reading in sample.readings:
            extra = tuple(sorted(pair for pair in reading.labels if pair[0] not in ID_LABELS))
            self._values[(reading.field, extra)] = reading.value

    def get(self, key: str, **labels: str) -> float | None:
        return self._values.get((key, tuple(sorted(labels.items()))))


@dataclass(frozen=True, slots=True)
class Condition:
    """A rule that holds now: its reason, state and evidence (its episode's start is the
    monitor's to keep)."""

    reason: str
    state: State
    evidence: str


def _active(readings: Readings, reasons: Iterable[str]) -> list[str]:
    return [
        reason
        for reason in reasons
        if readings.get("gpu_clock_event_reason_active", reason=reason) == 1.0
    ]


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def gpu_conditions(
    readings: Readings,
    *,
    light_load: float,
    active_load: float,
    corrected_last_hour: float | None,
    corrected_limit: float,
) -> list[Condition]:
    """The conditions that hold in one NVML sample of a GPU."""
    if readings.get("gpu_healthy") == 0.0:
        return [
            Condition("device_lost", "unhealthy", "NVML lost the GPU (it does not answer by UUID)")
        ]
    found: list[Condition] = []
    uncorrected = readings.get("gpu_ecc_errors_total", type="uncorrected")
    remapped = readings.get("gpu_remapped_rows", cause="uncorrectable")
    counts = (
        f"{_number(uncorrected)} uncorrected ECC errors, "
        f"{_number(remapped)} rows remapped for uncorrectable errors"
    )
    if readings.get("gpu_row_remap_failed") == 1.0:
        found.append(Condition("row_remap_failed", "unhealthy", f"a row remap failed ({counts})"))
    if readings.get("gpu_row_remap_pending") == 1.0:
        found.append(
            Condition(
                "row_remap_pending",
                "unhealthy",
                f"row remap pending after uncorrectable errors: a GPU reset applies it ({counts})",
            )
        )
    if corrected_last_hour is not None and corrected_last_hour > corrected_limit:
        found.append(
            Condition(
                "correctable_ecc_rate",
                "degraded",
                f"{corrected_last_hour:g} corrected ECC errors in the last hour "
                f"(limit {corrected_limit:g})",
            )
        )
    utilization = readings.get("gpu_utilization_ratio")
    if utilization is None:  # MIG mode has none: the load-dependent rules do not apply
        return found
    load = f"at {utilization:.0%} utilization"
    if utilization <= light_load:
        thermal = _active(readings, THERMAL)
        if thermal:
            temperature = readings.get("gpu_temperature_celsius", sensor="gpu")
            slowdown = readings.get("gpu_temperature_threshold_celsius", threshold="slowdown")
            found.append(
                Condition(
                    "thermal_while_idle",
                    "degraded",
                    f"{', '.join(thermal)} {load} (GPU {_number(temperature)} °C, slowdown at "
                    f"{_number(slowdown)} °C)",
                )
            )
        brake = _active(readings, POWER_BRAKE)
        if brake:
            power = readings.get("gpu_power_watts")
            limit = readings.get("gpu_power_limit_watts")
            found.append(
                Condition(
                    "power_brake_while_idle",
                    "degraded",
                    f"{', '.join(brake)} {load} ({_number(power)} W of {_number(limit)} W)",
                )
            )
    if utilization >= active_load:
        found.extend(_busy_conditions(readings, load))
    return found


def _busy_conditions(readings: Readings, load: str) -> list[Condition]:
    found = []
    generation = readings.get("gpu_pcie_link_generation")
    generation_max = readings.get("gpu_pcie_link_generation_max")
    width = readings.get("gpu_pcie_link_width")
    width_max = readings.get("gpu_pcie_link_width_max")
    if (
        generation is not None
        and generation_max is not None
        and width is not None
        and width_max is not None
        and (generation < generation_max or width < width_max)
    ):
        found.append(
            Condition(
                "pcie_link_degraded",
                "degraded",
                f"PCIe gen {generation:g} x{width:g} on a gen {generation_max:g} "
                f"x{width_max:g} link {load}",
            )
        )
    if _active(readings, ("applications_clocks_setting",)):
        clock = readings.get("gpu_clock_hertz", clock="sm")
        maximum = readings.get("gpu_clock_max_hertz", clock="sm")
        shown = (
            f"SM {clock / 1e6:.0f} of {maximum / 1e6:.0f} MHz"
            if clock is not None and maximum is not None
            else "SM clock below its maximum"
        )
        found.append(
            Condition(
                "applications_clocks_below_max",
                "degraded",
                f"clocks held by the applications-clocks setting: {shown} {load}",
            )
        )
    return found
