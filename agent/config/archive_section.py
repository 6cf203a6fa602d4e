"""The ``[archive]`` and ``[occupancy]`` sections: where results are kept, who holds a device."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from sqlalchemy.exc import NoSuchModuleError

from agent.config import database_url as urls
from agent.config.base import DAY_SECONDS, _Section


class OccupancySection(_Section):
    pod_resources_socket: Path = Field(
        default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        description="The kubelet's PodResources API socket; absent means not on Kubernetes.",
    )
    pod_resources_interval_seconds: float = Field(
        default=30.0,
        ge=1,
        le=DAY_SECONDS,
        description="Ask the kubelet which pods hold which devices at most this often "
        "(in the background, never per scrape).",
    )
    pod_resources_timeout_seconds: float = Field(
        default=5.0, gt=0, le=60, description="Deadline of one PodResources List call."
    )
    slurm: bool = Field(
        default=True,
        description="Name the Slurm job of the processes on each GPU (from their cgroup or "
        "SLURM_JOB_ID under host.procfs).",
    )


class ArchiveSection(_Section):
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy database URL; unset means a SQLite file data_dir/sustain.db.",
    )
    auto_upgrade: bool = Field(
        default=True, description="Apply pending schema migrations when the daemon starts."
    )
    rollup_seconds: int = Field(
        default=60,
        ge=1,
        le=3600,
        description="Length of one telemetry rollup period (one row per device field per period).",
    )
    retention_days: float = Field(
        default=90.0, gt=0, description="Rollup rows older than this are deleted (checked hourly)."
    )
    events_retention_days: float = Field(
        default=365.0, gt=0, description="Events older than this are deleted (checked hourly)."
    )
    probe_runs_retention_days: float = Field(
        default=730.0,
        gt=0,
        description="Probe runs and their iteration series older than this are deleted (hourly).",
    )
    spool_path: Path | None = Field(
        default=None,
        description="Local spool file that holds archive writes until the database has them; "
        "unset means data_dir/spool.db.",
    )
    local_database_url: str | None = Field(
        default=None,
        description="With a PostgreSQL archive (a fleet's): the node-local SQLite database that "
        "keeps this node's rollups of rollup_seconds (for forensics, under retention_days); unset "
        "means a SQLite file data_dir/rollups.db. Unused with a SQLite archive, which keeps them.",
    )
    fleet_rollup_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86_400,
        description="With a PostgreSQL archive: also send the fleet database rollups of this "
        "coarser period (e.g. 3600); unset sends none (dense telemetry is Prometheus' job).",
    )

    @field_validator("database_url", "local_database_url")
    @classmethod
    def _url_is_well_formed(cls, value: str | None) -> str | None:
        if value is None:
            return None
        url = urls.parse(value)  # DatabaseUrlError is a ValueError: one line, no URL
        unsupported = urls.unsupported_backend(url)
        if unsupported is not None:
            raise ValueError(unsupported)
        try:
            url.get_dialect()
        except NoSuchModuleError:
            raise ValueError(f"unknown database driver {url.drivername!r}") from None
        if url.get_backend_name() == "sqlite" and not url.database:
            raise ValueError("a SQLite URL needs a file path (sqlite:////path/to/sustain.db)")
        return value

    @field_validator("local_database_url")
    @classmethod
    def _local_is_sqlite(cls, value: str | None) -> str | None:
        if value is not None and urls.parse(value).get_backend_name() != "sqlite":
            raise ValueError("the node-local rollups database must be SQLite (sqlite:////path)")
        return value
