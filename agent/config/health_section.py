"""The ``[health]`` section: what makes a device degraded or unhealthy."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from agent.config.base import DAY_SECONDS, _Section

# XIDs that mean the GPU needs a reset or is off the bus (NVIDIA's XID catalogue: docs/health.md).
RESET_XIDS = (48, 74, 79, 92, 94, 95, 119, 120)


class HealthSection(_Section):
    enabled: bool = Field(
        default=True, description="Evaluate each device's health every sampler period."
    )
    unhealthy_xids: list[Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=lambda: list(RESET_XIDS),
        description="XIDs that make a GPU unhealthy until an operator clears it or it is reset.",
    )
    hold_seconds: float = Field(
        default=30.0,
        ge=0,
        le=DAY_SECONDS,
        description="A condition (PCIe link, idle throttling, applications clocks) counts only "
        "once it has held this long.",
    )
    light_load_utilization: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="At or below this GPU utilization a thermal or power-brake clock reason is "
        "a fault, not the load's doing.",
    )
    active_utilization: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="At or above this GPU utilization the GPU is not idle: its PCIe link must run "
        "at full generation and width, and its clocks must not be held by applications clocks.",
    )
    probe_failures: int = Field(
        default=3,
        ge=1,
        le=100,
        description="This many consecutive failed or timed-out probe runs on an idle device make "
        "it unhealthy.",
    )
    baseline_threshold: float = Field(
        default=0.10,
        gt=0,
        lt=1,
        description="A device whose steady throughput or sustained ratio is this far below its "
        "peers' median (same model, stack, probe and size) is degraded.",
    )
    baseline_runs: int = Field(
        default=2, ge=1, le=20, description="How many consecutive runs must be below the baseline."
    )
    baseline_min_peers: int = Field(
        default=3, ge=1, le=1000, description="Fewest peer devices that make a baseline."
    )
    baseline_days: float = Field(
        default=14.0,
        gt=0,
        le=365,
        description="Peers' results older than this do not count toward the baseline.",
    )
    coupling_low_runs: int = Field(
        default=3,
        ge=1,
        le=100,
        description="This many consecutive node-wide runs below probing.coupling_threshold make "
        "the device degraded.",
    )
    correctable_ecc_per_hour: float = Field(
        default=100.0,
        gt=0,
        description="More corrected ECC errors than this over the last hour make a GPU degraded.",
    )
    max_evidence_age_seconds: float = Field(
        default=300.0,
        ge=10,
        le=DAY_SECONDS,
        description="A verdict whose evidence is older than this is unknown: a device the agent "
        "has not sampled for this long, and an archived verdict (the agent not answering) "
        "recorded longer ago.",
    )
    expected_gpus: int | None = Field(
        default=None,
        ge=0,
        le=4096,
        description="How many GPUs this node has; fewer identified by NVML make the node "
        "unhealthy (gpus_missing). Unset: the GPUs the node has had (the archive, the PCI bus) "
        "are expected.",
    )
