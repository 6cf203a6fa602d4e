"""Configuration: embedded defaults < TOML file < ``SUSTAIN_*`` environment < command-line flags.

Validated with pydantic-settings so that every problem is reported with the dotted key it belongs
to. ``load`` raises ``ConfigError`` carrying one line per problem; the CLI prints them and exits 2.
Environment variables use ``__`` between sections: ``SUSTAIN_EXPORTER__LISTEN=127.0.0.1:9477``.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from difflib import get_close_matches
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)
from sqlalchemy.engine import URL

from agent.config import database_url as urls
from agent.config import names, problems, webconfig
from agent.config.archive_section import ArchiveSection, OccupancySection
from agent.config.base import DAY_SECONDS, YEAR_SECONDS, _Section
from agent.config.health_section import HealthSection
from agent.config.problems import Sources, environment_json_lines, one_line, problem_line

ENV_PREFIX = "SUSTAIN_"
DEFAULT_PORT = 9477


class ConfigError(Exception):
    """The configuration is invalid. ``problems`` holds one readable line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def default_data_dir() -> Path:
    """/var/lib/sustain for root (the service), the XDG data directory for anyone else."""
    if os.geteuid() == 0:
        return Path("/var/lib/sustain")
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "sustain"


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6; an empty host means all interfaces)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is outside 0-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", port  # noqa: S104 - an empty host means all interfaces


def redact_url(url: str) -> str:
    """A database URL with its secrets replaced, safe for logs and error messages."""
    return urls.redact_text(url) or "<unusable database URL>"


class AgentSection(_Section):
    node: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        description="Node name recorded with every archived row (the exporter adds no host label).",
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Directory for the embedded SQLite archive and other local state.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the daemon (logs go to standard error)."
    )


class ExporterSection(_Section):
    listen: str = Field(
        default=f"0.0.0.0:{DEFAULT_PORT}",
        description="HOST:PORT the HTTP exporter binds (/metrics, /healthz, /).",
    )
    window_seconds: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="Length of the window behind the *_window_mean and *_window_max families.",
    )
    web_config_file: Path | None = Field(
        default=None,
        description="Prometheus-style web configuration file (TLS, basic auth); unset: plain HTTP.",
    )
    header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Seconds a client has, from its connection, to send its request line and "
        "headers; past it the connection is closed (slow clients, slow loris).",
    )
    max_connections: int = Field(
        default=256,
        ge=1,
        le=4096,
        description="Requests served at once, one thread each; others with complete headers "
        "wait their turn, those still sending headers cost no thread.",
    )
    auth_rate_per_second: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="bcrypt password checks a second per client address (burst 5) with basic "
        "auth; past it new credentials are answered 429 without a check.",
    )
    docs_url: str = Field(
        default="",
        max_length=2048,
        description="Base URL where sustain's docs/ folder is published; the landing page at / "
        "links metrics.md, health.md, alerts.md and probe.md under it. Empty: it names them.",
    )

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("docs_url")
    @classmethod
    def _docs_url_is_http(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value

    @field_validator("web_config_file")
    @classmethod
    def _web_config_parses(cls, value: Path | None) -> Path | None:
        """Structure, values and the files it names; the key itself is read by `config check`
        and by the server only, so that other commands need no access to it."""
        if value is not None:
            try:
                webconfig.load(value)
            except webconfig.WebConfigError as exc:
                message = str(exc)  # the file's name, unless the message says it already
                if str(value) not in message:
                    message += f" (got {str(value)!r})"
                raise ValueError(message) from None
        return value


class SamplerSection(_Section):
    interval_seconds: float = Field(
        default=1.0, gt=0, le=3600, description="Baseline sampling interval of every collector."
    )
    buffer_samples: int = Field(
        default=1024,
        ge=16,
        le=1_000_000,
        description="Ring-buffer capacity per device and field (bounds the agent's memory).",
    )
    stall_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A sampler loop with no finished poll for this long is stalled (/healthz 503).",
    )


class HostSection(_Section):
    enabled: bool = Field(
        default=True, description="Collect host CPU, memory, load, temperature, RAPL."
    )
    procfs: Path = Field(
        default=Path("/proc"), description="Root of procfs (a fixture tree in tests)."
    )
    sysfs: Path = Field(
        default=Path("/sys"), description="Root of sysfs (a fixture tree in tests)."
    )


class NvmlSection(_Section):
    enabled: bool = Field(
        default=True,
        description="Collect NVIDIA GPU telemetry through NVML (reported down where no driver).",
    )
    absent_retry_seconds: float = Field(default=60.0, gt=0, le=300, description="NVML lookup wait.")


OPTIMIZATIONS = names.OPTIMIZATIONS


def _plan_workload(info: ValidationInfo) -> list[str]:
    """The entry's workload, where it is a known one (fields are validated in order)."""
    return [info.data["workload"]] if "workload" in info.data else []


def _known_precision(value: str, info: ValidationInfo) -> str:
    names.check_precision(value, _plan_workload(info))
    return value


def _known_optimization(value: Any, info: ValidationInfo) -> Any:
    """Before the Literal check, so that a misspelt level gets a suggestion."""
    if isinstance(value, str):
        names.check_optimization(value, _plan_workload(info))
    return value


class ProbePlanEntry(_Section):
    """One line of the probe plan: a workload, the variants to run, and when."""

    workload: str = Field(min_length=1, description="Workload name (`python -m workloads list`).")
    precisions: list[Annotated[str, AfterValidator(_known_precision)]] = Field(
        default_factory=lambda: ["fp32"], min_length=1, description="Precisions to run, in order."
    )
    optimizations: list[
        Annotated[Literal["eager", "compiled", "fast_accum"], BeforeValidator(_known_optimization)]
    ] = Field(
        default_factory=lambda: list[Literal["eager", "compiled", "fast_accum"]](["eager"]),
        min_length=1,
        description="Optimization levels to run.",
    )
    duration_seconds: float = Field(default=20.0, gt=0, le=3600, description="Length of one run.")
    size: Literal["small", "default"] = Field(
        default="default", description="Problem size: chosen from the device, or small."
    )
    interval_seconds: float | None = Field(
        default=None,
        gt=0,
        le=YEAR_SECONDS,
        description="Run every this many seconds (or give `cron`).",
    )
    cron: str | None = Field(default=None, description="Crontab expression (5 fields), UTC.")
    jitter_seconds: float = Field(
        default=300.0,
        ge=0,
        le=DAY_SECONDS,
        description="Random delay added to each start, spreading a fleet.",
    )
    scope: Literal["device", "node"] = Field(
        default="device",
        description="device: one device at a time (solo); node: every device of the node at "
        "once, started together (node-wide; allreduce always is).",
    )

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        names.check_workload(value)
        return value

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, value: str | None) -> str | None:
        if value is not None:
            from apscheduler.triggers.cron import CronTrigger  # noqa: PLC0415 - config check only

            try:
                CronTrigger.from_crontab(value, timezone="UTC")
            except ValueError as exc:
                raise ValueError(f"invalid crontab expression {value!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _one_schedule(self) -> ProbePlanEntry:
        if (self.interval_seconds is None) == (self.cron is None):
            raise ValueError("give exactly one of interval_seconds and cron")
        return self


def _default_plan() -> list[ProbePlanEntry]:
    return [
        ProbePlanEntry(
            workload="matmul",
            precisions=["bf16", "fp32"],
            duration_seconds=20,
            interval_seconds=3600,
        ),
        ProbePlanEntry(
            workload="membw", precisions=["fp32"], duration_seconds=15, interval_seconds=3600
        ),
    ]


class ProbingSection(_Section):
    enabled: bool = Field(default=True, description="Run the probe plan on a schedule.")
    plan: list[ProbePlanEntry] = Field(
        default_factory=_default_plan, description="What to probe and when ([[probing.plan]])."
    )
    duty_cycle: float = Field(
        default=0.02,
        gt=0,
        le=1,
        description="Most probe time per device over the last hour, as a share of wall time.",
    )
    initial_delay_seconds: float = Field(
        default=120.0,
        ge=0,
        le=DAY_SECONDS,
        description="Wait this long after start-up before the first probe.",
    )
    skip_retry_seconds: float = Field(
        default=60.0,
        ge=0,
        le=DAY_SECONDS,
        description="A plan entry's runs skipped (device busy, duty cycle) are tried again after "
        "this long, then twice as long each time, until they run or the entry's next scheduled "
        "round comes first; 0 waits for that round.",
    )
    busy_gpu_utilization: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Skip a GPU whose mean utilization over the last minute is above this.",
    )
    busy_cpu_utilization: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Skip CPU probes while host CPU utilization over the last minute is higher.",
    )
    skip_foreign_processes: bool = Field(
        default=True, description="Skip a GPU that runs compute processes other than the agent's."
    )
    preempt: bool = Field(
        default=True,
        description="Stop a running probe when foreign work arrives on its device: a compute "
        "process on its GPU, or a process above preempt_cpu_share on the CPU.",
    )
    preempt_cpu_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="A foreign process using more than this share of all CPUs (over 0.5 s) "
        "preempts a running CPU probe.",
    )
    coupling_threshold: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="A node-wide run whose coupling ratio (node-wide over solo steady throughput) "
        "is below this counts toward sustain_probe_node_coupling_low_runs.",
    )
    startup_timeout_seconds: float = Field(
        default=180.0,
        gt=0,
        description="Time a probe child may take beyond its duration (start-up, torch.compile).",
    )
    run_grace_seconds: float = Field(default=3.0, gt=0, description="A run's overrun, at most.")
    fast_interval_seconds: float = Field(
        default=0.1, gt=0, le=10, description="Sampling interval while a probe runs."
    )
    python: str | None = Field(
        default=None, description="Interpreter for probe children (default: the agent's own)."
    )
    tolerance: float = Field(
        default=0.02,
        gt=0,
        lt=1,
        description="Relative equivalence of segments in the steady-state analysis.",
    )
    record: bool = Field(
        default=False,
        description="`sustain probe` archives its runs as the daemon's are (also `--record`).",
    )


class StackSection(_Section):
    interval_seconds: float = Field(
        default=600.0,
        ge=10,
        le=YEAR_SECONDS,
        description="How often the stack is read again (it is also read after every probe run).",
    )
    container_image: str | None = Field(
        default=None,
        description="Container image recorded in the stack; unset: $SUSTAIN_CONTAINER_IMAGE.",
    )


class DriftSection(_Section):
    enabled: bool = Field(
        default=True, description="Look for drift in this node's probe results on a schedule."
    )
    interval_seconds: float = Field(
        default=3600.0, ge=10, le=YEAR_SECONDS, description="How often the drift detection runs."
    )
    window: int = Field(
        default=50, ge=8, le=1000, description="Results per window of the change-point detection."
    )
    max_pvalue: float = Field(
        default=0.001, gt=0, lt=1, description="Significance a change point needs (t-test)."
    )
    min_magnitude: float = Field(
        default=0.03, ge=0, lt=1, description="Smallest relative change reported as drift."
    )
    history: int = Field(
        default=500,
        ge=10,
        le=100_000,
        description="Most recent results per device, workload, precision and optimization read.",
    )
    outlier_ratio: float = Field(
        default=0.10,
        gt=0,
        lt=1,
        description="A device this far below the median of identical devices is a fleet outlier.",
    )


class _FileSource(PydanticBaseSettingsSource):
    """The parsed TOML file, placed below the environment in precedence."""

    def __init__(self, settings_cls: type[BaseSettings], data: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = dict(data)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._data


class Settings(BaseSettings):
    """The effective configuration of one agent."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    agent: AgentSection = Field(default_factory=AgentSection)
    exporter: ExporterSection = Field(default_factory=ExporterSection)
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    host: HostSection = Field(default_factory=HostSection)
    nvml: NvmlSection = Field(default_factory=NvmlSection)
    probing: ProbingSection = Field(default_factory=ProbingSection)
    archive: ArchiveSection = Field(default_factory=ArchiveSection)
    stack: StackSection = Field(default_factory=StackSection)
    drift: DriftSection = Field(default_factory=DriftSection)
    health: HealthSection = Field(default_factory=HealthSection)
    occupancy: OccupancySection = Field(default_factory=OccupancySection)

    @property
    def database_url(self) -> str:
        """The archive URL, with the embedded SQLite default resolved."""
        if self.archive.database_url is not None:
            return self.archive.database_url
        path = (self.agent.data_dir / "sustain.db").absolute()
        return URL.create("sqlite", database=str(path)).render_as_string()

    @property
    def fleet_archive(self) -> bool:
        """Whether the archive is a fleet's PostgreSQL (rollups then stay on the node)."""
        return self.database_url.startswith("postgresql")

    @property
    def local_database_url(self) -> str:
        """The node-local rollups' SQLite URL, with its default resolved."""
        if self.archive.local_database_url is not None:
            return self.archive.local_database_url
        path = (self.agent.data_dir / "rollups.db").absolute()
        return URL.create("sqlite", database=str(path)).render_as_string()

    @property
    def local_spool_path(self) -> Path:
        """The spool of the node-local rollups, beside the archive's."""
        return self.spool_path.with_name(self.spool_path.stem + "-rollups.db")

    @property
    def spool_path(self) -> Path:
        return (self.archive.spool_path or self.agent.data_dir / "spool.db").absolute()

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.exporter.listen)


def _settings_class(file_data: Mapping[str, Any], use_env: bool) -> type[Settings]:
    """A Settings subclass whose sources are: flags > environment (if used) > this file's data.

    pydantic-settings asks the class, not the instance, for its sources, so each load gets its own
    small subclass instead of shared mutable state.
    """

    class Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            file_source = _FileSource(settings_cls, file_data)
            if use_env:
                return init_settings, env_settings, file_source
            return init_settings, file_source

    return Loaded


MAX_CONFIG_BYTES = 1 << 20  # a longer file is no configuration (or is a device: /dev/zero)


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; syntax errors become a ConfigError naming the file and line."""
    name = one_line(str(path), limit=None)
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError([f"{name}: no such file"]) from None
    except OSError as exc:
        raise ConfigError([f"{name}: cannot read: {exc.strerror or exc}"]) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{name}: larger than {MAX_CONFIG_BYTES >> 20} MiB"])
    try:
        return tomllib.loads(data.decode())
    except UnicodeDecodeError:
        raise ConfigError([f"{name}: not UTF-8 text"]) from None
    except tomllib.TOMLDecodeError as exc:
        # The message may quote a key of any length; what it ends with says where.
        what, at, where = str(exc).rpartition(" (at ")
        detail = f"{one_line(what)}{at}{where}" if at else one_line(str(exc))
        raise ConfigError([f"{name}: TOML syntax error: {detail}"]) from None
    except ValueError as exc:  # int()'s digit limit, which tomllib does not wrap
        raise ConfigError([f"{name}: unusable value: {one_line(str(exc))}"]) from None
    except RecursionError:
        raise ConfigError([f"{name}: arrays or tables nested too deeply"]) from None


def _problem_lines(error: ValidationError, sources: Sources) -> list[str]:
    # Keys, messages and values come from the user: each is cut short and kept on one line.
    return [
        problem_line(
            item,
            sources.where(item["loc"]),
            problems.quoted,
            problems.message_naming_a_file,
            model=Settings,
        )
        for item in error.errors()
    ]


def load(
    path: Path | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    use_env: bool = True,
    flag_names: Mapping[tuple[str, str], str] | None = None,
) -> Settings:
    """Build the effective settings from defaults, ``path``, the environment and ``overrides``.

    ``overrides`` are section -> key -> value, as given by command-line flags; ``flag_names``
    says which flag gave each (section, key), for the problem lines.
    """
    file_data = read_toml(path) if path is not None else {}
    if path is not None:
        urls.warn_if_exposed(path, file_data)
    settings_cls = _settings_class(file_data, use_env)
    environ = {
        name: value for name, value in os.environ.items() if name.upper().startswith(ENV_PREFIX)
    }
    unknown = unknown_sections(environ) if use_env else []
    try:
        # Sections go in as plain dicts; pydantic validates them (mypy sees only the
        # settings-class keyword arguments in the signature).
        sections: dict[str, Any] = {k: dict(v) for k, v in (overrides or {}).items()}
        settings: Settings = cast(Any, settings_cls)(**sections)
    except ValidationError as exc:
        file_name = None if path is None else one_line(str(path), limit=None)
        sources = Sources(
            file_name=file_name,
            file_data=file_data,
            environ=environ if use_env else {},
            flags=overrides or {},
            flag_names=flag_names or {},
            env_prefix=ENV_PREFIX,
        )
        raise ConfigError(unknown + _problem_lines(exc, sources)) from None
    except SettingsError:  # a variable that sets a list or table and holds no JSON
        lines = environment_json_lines(environ, Settings, ENV_PREFIX)
        raise ConfigError(lines or ["environment: a SUSTAIN_ variable is not valid JSON"]) from None
    if unknown:
        raise ConfigError(unknown)
    return settings


def unknown_sections(environ: Mapping[str, str]) -> list[str]:
    """``SUSTAIN_SECTION__KEY`` variables whose section the configuration lacks, which
    pydantic-settings passes over without a word (a ``[section]`` in the file is refused). A
    variable without ``__`` is not a setting of a section (``SUSTAIN_CONFIG``) and is left be."""
    lines = []
    for name in sorted(environ):
        section, nested, _ = name[len(ENV_PREFIX) :].lower().partition("__")
        if not nested or section in Settings.model_fields:
            continue
        near = get_close_matches(section, list(Settings.model_fields), n=1, cutoff=0.6)
        hint = f" (did you mean {ENV_PREFIX}{near[0].upper()}__...?)" if near else ""
        lines.append(f"{one_line(name)}: unknown section {section!r}{hint}")
    return lines


def check_environment() -> list[str]:
    """Every problem of the ``SUSTAIN_*`` environment over the embedded defaults: what would stop
    the agent here whatever its file says (an unknown section, a switch that is not true or
    false)."""
    try:
        load(None)
    except ConfigError as exc:
        return exc.problems
    return []


def check_file(path: Path) -> list[str]:
    """Every problem of one config file on its own (the environment is not consulted: see
    ``check_environment``).

    Beyond ``load``, the TLS certificate and key of the web configuration file are loaded, so
    that a key that does not match its certificate is found here, not at the next restart.
    """
    try:
        settings = load(path, use_env=False)
    except ConfigError as exc:
        return exc.problems
    web_config_file = settings.exporter.web_config_file
    if web_config_file is not None:
        try:
            tls = webconfig.load(web_config_file).tls
            if tls is not None:
                webconfig.server_context(tls)
        except webconfig.WebConfigError as exc:
            name = one_line(str(path), limit=None)
            return [f"{name}: exporter.web_config_file: {exc} (got {str(web_config_file)!r})"]
    return []


def redacted(settings: Settings) -> dict[str, Any]:
    """The effective settings as plain data, database passwords replaced."""
    data = settings.model_dump(mode="json")
    data["archive"]["database_url"] = redact_url(settings.database_url)
    return data
