"""Exposition of each device's health verdict (agent.health)::

sustain_device_health{device="1",state="unhealthy",uuid="GPU-2b9e..."} 1.0
sustain_device_health{device="1",state="healthy",uuid="GPU-2b9e..."} 0.0
sustain_device_health_reason{device="1",reason="xid_79",uuid="GPU-2b9e..."} 1.0
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from agent.health.monitor import DeviceHealth
from agent.health.rules import STATES


def health_families(verdicts: Sequence[DeviceHealth]) -> Iterator[Metric]:
    health = GaugeMetricFamily(
        "sustain_device_health",
        "1 for the device's current health state (healthy, degraded, unhealthy, unknown: no "
        "current evidence), 0 for the others; the reasons are sustain_device_health_reason "
        "(docs/health.md).",
        labels=["device", "uuid", "state"],
    )
    reasons = GaugeMetricFamily(
        "sustain_device_health_reason",
        "1 for each reason that makes the device degraded or unhealthy now.",
        labels=["device", "uuid", "reason"],
    )
    acknowledged = GaugeMetricFamily(
        "sustain_device_health_acknowledged",
        "1 for each reason an operator acknowledged (sustain health clear) that still holds; "
        "it no longer counts toward the state until new evidence of it arrives.",
        labels=["device", "uuid", "reason"],
    )
    for verdict in verdicts:
        for state in STATES:
            health.add_metric(
                [verdict.label, verdict.uuid, state], 1.0 if verdict.state == state else 0.0
            )
        for finding in verdict.findings:
            reasons.add_metric([verdict.label, verdict.uuid, finding.reason], 1.0)
        for finding in verdict.acknowledged:
            acknowledged.add_metric([verdict.label, verdict.uuid, finding.reason], 1.0)
    yield health
    yield reasons
    yield acknowledged
