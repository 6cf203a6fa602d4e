"""Prometheus exposition: fresh metric families built on every scrape from the telemetry store.

Nothing is registered up front, so a series that vanished from the last poll is gone from the next
scrape. Besides its latest value, every windowed field is exported as the mean and the max over a
fixed trailing window, so a spike between two scrapes still shows::

    # HELP sustain_cpu_utilization_ratio Busy share of all CPUs since the previous poll. ...
    # TYPE sustain_cpu_utilization_ratio gauge
    sustain_cpu_utilization_ratio 0.231
    sustain_cpu_utilization_window_max_ratio 0.874
    sustain_collector_up{collector="host"} 1.0
"""

from __future__ import annotations

import platform
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector
from prometheus_client.samples import Sample

from agent import __version__
from agent.archive.sink import KINDS as ARCHIVE_KINDS
from agent.archive.sink import ArchiveStatus
from agent.drift.job import SERIES_LABELS, DriftStatus
from agent.exporter.health import health_families
from agent.exporter.occupancy import occupancy_families
from agent.health.monitor import DeviceHealth
from agent.occupancy.tracker import OccupancyStatus
from agent.probes.scheduler import LATENCY_QUANTILES
from agent.probes.status import ProbeResult, ProbeStatus
from agent.stack.tracker import INFO_LABELS, StackStatus
from agent.telemetry.sampler import LoopStatus
from agent.telemetry.store import TelemetryStore
from collectors.base import Field, Labels, Reading

WINDOW_HELP = {"mean": "Mean", "max": "Maximum"}
LABEL_CACHE_LIMIT = 200_000  # series whose label dicts are kept; past it the cache starts over
_NO_LABELS: dict[str, str] = {}

Catalogue = Mapping[str, Mapping[str, Field]]  # collector name -> field key -> Field


_LOOP_FAMILIES: tuple[
    tuple[
        type[GaugeMetricFamily] | type[CounterMetricFamily],
        str,
        str,
        Callable[[LoopStatus], float | None],
    ],
    ...,
] = (
    (
        GaugeMetricFamily,
        "sustain_collector_up",
        "1 when the collector's last poll read something, 0 when it read nothing; no series "
        "for a collector that does not apply to the node (see sustain_collector_absent).",
        lambda status: None if status.absent else 1.0 if status.up else 0.0,
    ),
    (
        CounterMetricFamily,
        "sustain_collector_polls",
        "Polls of the collector.",
        lambda status: status.polls,
    ),
    (
        GaugeMetricFamily,
        "sustain_collector_poll_duration_seconds",
        "Time the collector's last poll took.",
        lambda status: status.last_duration_seconds,
    ),
    (
        GaugeMetricFamily,
        "sustain_sampler_interval_seconds",
        "Configured polling interval of the sampler loop.",
        lambda status: status.interval_seconds,
    ),
    (
        GaugeMetricFamily,
        "sustain_sampler_lag_seconds",
        "How late the loop's last poll started against its deadline.",
        lambda status: status.last_lag_seconds,
    ),
    (
        CounterMetricFamily,
        "sustain_sampler_missed_polls",
        "Deadlines skipped because a poll overran its slot.",
        lambda status: status.missed_polls,
    ),
    (
        GaugeMetricFamily,
        "sustain_sampler_last_poll_timestamp_seconds",
        "Unix time the loop's last poll finished.",
        lambda status: status.last_poll_timestamp,
    ),
    (
        GaugeMetricFamily,
        "sustain_sampler_stalled",
        "1 when the loop has finished no poll for its stall time (see /healthz).",
        lambda status: 1.0 if status.stalled else 0.0,
    ),
)


_PROBE_LABELS = ["workload", "precision", "optimization", "device", "uuid"]

# One family per unit (the Prometheus naming guide: a metric's name carries its one unit): the
# workloads' units (workloads/*.py, "unit") -> throughput family, work-per-joule family.
UNIT_FAMILIES: Mapping[str, tuple[str, str]] = {
    "FLOP/s": ("sustain_probe_flops", "sustain_probe_flop_per_joule"),
    "B/s": ("sustain_probe_bytes_per_second", "sustain_probe_bytes_per_joule"),
    "tokens/s": ("sustain_probe_tokens_per_second", "sustain_probe_tokens_per_joule"),
}
WORK_NAMES = {"FLOP/s": "Floating-point operations", "B/s": "Bytes moved", "tokens/s": "Tokens"}


def _probe_families(status: ProbeStatus) -> Iterator[Metric]:
    runs = CounterMetricFamily(
        "sustain_probe_runs",
        "Probe runs by outcome (ok, failed, timeout, unsupported, skipped, aborted, preempted).",
        labels=[*_PROBE_LABELS, "outcome"],
    )
    preempted: Counter[tuple[str, ...]] = Counter()
    for key, count in sorted(status.runs.items()):
        runs.add_metric(list(key), count)
        preempted[key[:-1]] += count if key[-1] == "preempted" else 0
    yield runs
    skips = CounterMetricFamily(
        "sustain_probe_skips",
        "Probe runs skipped before they started, by why: duty_cycle, foreign_processes, "
        "gpu_busy, cpu_busy, mig_unknown.",
        labels=[*_PROBE_LABELS, "reason"],
    )
    for key, count in sorted(status.skips.items()):
        skips.add_metric(list(key), count)
    yield skips
    # From a probe's first run on, 0 until it yields: increase() sees the first preemption.
    preemptions = CounterMetricFamily(
        "sustain_probe_preemptions",
        "Probe runs stopped because foreign work arrived on their device (probing.preempt).",
        labels=_PROBE_LABELS,
    )
    for labels, count in preempted.items():
        preemptions.add_metric(list(labels), count)
    yield preemptions
    last = GaugeMetricFamily(
        "sustain_probe_last_run_timestamp_seconds",
        "Unix time the last run of this probe ended (skipped runs excluded).",
        labels=_PROBE_LABELS,
    )
    for probe, timestamp in sorted(status.last_run.items()):
        last.add_metric(list(probe), timestamp)
    yield last
    running = GaugeMetricFamily(
        "sustain_probe_running",
        "1 while a probe runs on the device.",
        labels=["device", "uuid"],
    )
    for device, active in sorted(status.running.items()):
        running.add_metric(list(device), 1.0 if active else 0.0)
    yield running
    yield from _probe_result_families(status)
    duty = GaugeMetricFamily(
        "sustain_probe_duty_cycle_ratio",
        "Share of the last hour the device spent running probes.",
        labels=["device", "uuid"],
    )
    for device, share in sorted(status.duty_used.items()):
        duty.add_metric(list(device), share)
    yield duty


def _probe_result_families(status: ProbeStatus) -> Iterator[Metric]:
    """The latest analysed result of each probe: peak and steady, and why they differ."""
    throughput = {unit: _throughput_family(unit, name) for unit, (name, _) in UNIT_FAMILIES.items()}
    ratio = GaugeMetricFamily(
        "sustain_probe_sustained_ratio",
        "Steady throughput over peak throughput of the latest run.",
        labels=_PROBE_LABELS,
    )
    warmup = GaugeMetricFamily(
        "sustain_probe_warmup_seconds",
        "Time from the start of the latest run to its steady state.",
        labels=_PROBE_LABELS,
    )
    classification = GaugeMetricFamily(
        "sustain_probe_classification",
        "Classification of the latest run (flat, warmup, slowdown, no_steady_state, "
        "insufficient); value 1.",
        labels=[*_PROBE_LABELS, "classification"],
    )
    cause = GaugeMetricFamily(
        "sustain_probe_slowdown_cause",
        "Cause of the latest run's slowdown (thermal, power_brake, power_cap, "
        "clock_unexplained, not_clock_bound); value 1, present only for a slowdown.",
        labels=[*_PROBE_LABELS, "cause"],
    )
    share = GaugeMetricFamily(
        "sustain_probe_reason_share_ratio",
        "Share of the latest run's steady state spent under each clock-event reason.",
        labels=[*_PROBE_LABELS, "reason"],
    )
    efficiency = {
        unit: GaugeMetricFamily(
            name,
            f"{WORK_NAMES[unit]} per joule over the latest run (the device's energy counter: "
            "GPU board, RAPL package on the CPU).",
            labels=_PROBE_LABELS,
        )
        for unit, (_, name) in UNIT_FAMILIES.items()
    }
    latency = GaugeMetricFamily(
        "sustain_probe_latency_seconds",
        "Per-token decode latency of the latest inference run, by quantile (0.5, 0.9, 0.99).",
        labels=[*_PROBE_LABELS, "quantile"],
    )
    for key, result in sorted(status.results.items()):
        labels = list(key)
        for name, seconds in sorted(result.latency_seconds.items()):
            latency.add_metric([*labels, LATENCY_QUANTILES[name]], seconds)
        figures = result.analysis.figures
        _add_throughput(throughput, labels, result, "device")
        if figures.get("sustained_ratio") is not None:
            ratio.add_metric(labels, figures["sustained_ratio"])
        if figures.get("warmup_seconds") is not None:
            warmup.add_metric(labels, figures["warmup_seconds"])
        classification.add_metric([*labels, str(figures.get("classification"))], 1.0)
        attribution = result.analysis.attribution
        if attribution.cause is not None:
            cause.add_metric([*labels, attribution.cause], 1.0)
        if attribution.segments:
            steady = attribution.segments[-1]
            for reason, value in sorted(steady.reason_share.items()):
                share.add_metric([*labels, reason], value)
        if attribution.work_per_joule is not None and result.unit in efficiency:
            efficiency[result.unit].add_metric(labels, attribution.work_per_joule)
    for key, result in sorted(status.node_results.items()):
        _add_throughput(throughput, list(key), result, "node")
    yield from throughput.values()
    yield from (ratio, warmup, classification, cause, share)
    yield from efficiency.values()
    yield latency
    yield from _coupling_families(status)


def _throughput_family(unit: str, name: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(
        name,
        f"Achieved throughput ({unit}) of the probe's latest run: stat=peak (best short "
        "window, work over time), stat=steady (work over time of the steady state, absent "
        "without one), stat=p10 and "
        "stat=p50 (percentiles over one-second windows, present even without a steady state); "
        "scope=device for solo runs, scope=node for a device's run within a node-wide run and "
        "for the node's sum (device=node).",
        labels=[*_PROBE_LABELS, "stat", "scope"],
    )


def _add_throughput(
    families: Mapping[str, GaugeMetricFamily], labels: list[str], result: ProbeResult, scope: str
) -> None:
    family = families.get(result.unit)
    if family is None:  # a workload of another unit: no family of its own (a test catches it)
        return
    figures = result.analysis.figures
    for stat in ("peak", "steady", "p10", "p50"):
        value = figures.get(f"{stat}_throughput")
        if value is not None:
            family.add_metric([*labels, stat, scope], value)


def _coupling_families(status: ProbeStatus) -> Iterator[Metric]:
    """What each device (and the node, device="node") keeps of its solo throughput when every
    device of the node works at once."""
    ratio = GaugeMetricFamily(
        "sustain_probe_node_coupling_ratio",
        "Node-wide steady throughput of the device over its latest solo steady throughput "
        "(same workload, precision and size); device=node: the node's sum over the sum of the "
        "solo figures. 1 = nothing lost when every device works.",
        labels=_PROBE_LABELS,
    )
    cause = GaugeMetricFamily(
        "sustain_probe_node_coupling_cause",
        "Why the latest coupling ratio is below 0.95 (thermal, power_brake, power_cap, "
        "clock_unexplained, host_contention); value 1.",
        labels=[*_PROBE_LABELS, "cause"],
    )
    low = GaugeMetricFamily(
        "sustain_probe_node_coupling_low_runs",
        "Consecutive node-wide runs whose coupling ratio was below probing.coupling_threshold.",
        labels=_PROBE_LABELS,
    )
    for key, coupling in sorted(status.coupling.items()):
        labels = list(key)
        ratio.add_metric(labels, coupling.ratio)
        low.add_metric(labels, float(coupling.low_runs))
        if coupling.cause is not None:
            cause.add_metric([*labels, coupling.cause], 1.0)
    yield from (ratio, cause, low)


class AgentMetrics(PromCollector):
    """The agent's whole exposition, except the process metrics of prometheus_client."""

    def __init__(
        self,
        store: TelemetryStore,
        catalogue: Catalogue,
        loops: Callable[[], Sequence[LoopStatus]],
        window_seconds: float,
        *,
        archive: Callable[[], ArchiveStatus] | None = None,
        probes: Callable[[], ProbeStatus] | None = None,
        stack: Callable[[], StackStatus] | None = None,
        drift: Callable[[], DriftStatus] | None = None,
        occupancy: Callable[[], OccupancyStatus] | None = None,
        health: Callable[[], Sequence[DeviceHealth]] | None = None,
    ) -> None:
        self._health = health
        self._label_dicts: dict[Labels, dict[str, str]] = {}
        self._occupancy = occupancy
        self._stack = stack
        self._drift = drift
        self._store = store
        self._catalogue = catalogue
        self._loops = loops
        self._window = window_seconds
        self._archive = archive
        self._probes = probes

    def describe(self) -> list[Metric]:
        # An empty description keeps the registry from calling collect() at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._telemetry()
        yield from self._self_metrics()
        if self._probes is not None:
            yield from _probe_families(self._probes())
        if self._stack is not None:
            yield from _stack_families(self._stack())
        if self._drift is not None:
            yield from _drift_families(self._drift())
        if self._occupancy is not None:
            yield from occupancy_families(self._occupancy())
        if self._health is not None:
            yield from health_families(self._health())

    def _telemetry(self) -> Iterator[Metric]:
        since = time.time() - self._window
        readings: dict[tuple[str, str], list[tuple[str, Reading]]] = {}
        for sample in self._store.latest():
            for reading in sample.readings:
                readings.setdefault((sample.collector, reading.field), []).append(
                    (sample.device, reading)
                )
        intervals = {status.collector: status.interval_seconds for status in self._loops()}
        for collector, fields in sorted(self._catalogue.items()):
            interval = intervals.get(collector)
            suffix = f" Sampled every {interval:g} s." if interval else ""
            for key, field in fields.items():
                found = readings.get((collector, key))
                if found:
                    yield from self._field_families(collector, field, found, since, suffix)

    def _field_families(
        self,
        collector: str,
        field: Field,
        readings: list[tuple[str, Reading]],
        since: float,
        suffix: str,
    ) -> Iterator[Metric]:
        family_type = CounterMetricFamily if field.kind == "counter" else GaugeMetricFamily
        latest = family_type(field.metric_name, field.help + suffix, labels=list(field.labels))
        # Samples built directly, their label dicts kept from scrape to scrape (add_metric
        # would zip a new dict for every sample of every scrape).
        name = latest.name + ("_total" if field.kind == "counter" else "")
        append = latest.samples.append
        for _, reading in readings:
            append(Sample(name, self._labels(field, reading.labels), reading.value))
        yield latest
        if not field.windowed:
            return
        windows = {
            stat: GaugeMetricFamily(
                field.window_metric_name(stat),
                f"{field.help} {WINDOW_HELP[stat]} over the last {self._window:g} s.",
                labels=list(field.labels),
            )
            for stat in field.windowed
        }
        keys = [(collector, device, field.key, reading.labels) for device, reading in readings]
        for key, stats in zip(keys, self._store.windows(keys, since), strict=True):
            if stats is not None:
                labels = self._labels(field, key[3])
                for stat, family in windows.items():
                    value = stats.mean if stat == "mean" else stats.max
                    family.samples.append(Sample(family.name, labels, value))
        yield from windows.values()

    def _labels(self, field: Field, labels: Labels) -> dict[str, str]:
        """The label dict of a series, the same object every scrape (nothing mutates it)."""
        if not field.labels:
            return _NO_LABELS
        found = self._label_dicts.get(labels)
        if found is None:
            if len(self._label_dicts) >= LABEL_CACHE_LIMIT:
                self._label_dicts.clear()
            found = self._label_dicts[labels] = dict(labels)
        return found

    def _self_metrics(self) -> Iterator[Metric]:
        build = GaugeMetricFamily(
            "sustain_build_info",
            "Version of the agent and of the Python it runs on; value 1.",
            labels=["version", "python_version"],
        )
        build.add_metric([__version__, platform.python_version()], 1)
        yield build

        statuses = sorted(self._loops(), key=lambda status: status.collector)
        for family_type, name, help_text, value_of in _LOOP_FAMILIES:
            family = family_type(name, help_text, labels=["collector"])
            for status in statuses:
                value = value_of(status)
                if value is not None:
                    family.add_metric([status.collector], value)
            yield family
        errors = CounterMetricFamily(
            "sustain_collector_errors",
            "Failures met while polling, by kind (one unreadable field, or a whole poll).",
            labels=["collector", "kind"],
        )
        for status in statuses:
            for kind, count in sorted(status.errors.items()):
                errors.add_metric([status.collector, kind], count)
        yield errors
        absent = GaugeMetricFamily(
            "sustain_collector_absent",
            "1 while the collector's source is not installed on this node, by reason (nvml: "
            "library_not_found, driver_not_loaded); such a collector has no sustain_collector_up.",
            labels=["collector", "reason"],
        )
        for status in statuses:
            if status.absent is not None:
                absent.add_metric([status.collector, status.absent], 1.0)
        yield absent

        if self._archive is None:
            return
        archive = self._archive()
        yield GaugeMetricFamily(
            "sustain_rollup_pending_rows",
            "Finished rollup rows waiting to be written to the archive.",
            value=archive.pending_rows,
        )
        yield CounterMetricFamily(
            "sustain_rollup_rows_written",
            "Rollup rows written to the archive.",
            value=archive.rows_written,
        )
        yield GaugeMetricFamily(
            "sustain_events_pending",
            "Events waiting to be written to the archive.",
            value=archive.pending_events,
        )
        yield CounterMetricFamily(
            "sustain_events_written",
            "Events written to the archive.",
            value=archive.events_written,
        )
        yield CounterMetricFamily(
            "sustain_archive_write_errors",
            "Failed archive writes (their rows and events are kept and retried).",
            value=archive.write_errors,
        )
        yield CounterMetricFamily(
            "sustain_archive_write_conflicts_retried",
            "Archive writes that collided with another writer's transaction (deadlock or "
            "serialization failure) and were retried at once; not errors.",
            value=archive.write_conflicts_retried,
        )
        if archive.last_write_timestamp is not None:
            yield GaugeMetricFamily(
                "sustain_archive_last_write_timestamp_seconds",
                "Unix time of the last successful archive write.",
                value=archive.last_write_timestamp,
            )
        yield GaugeMetricFamily(
            "sustain_archive_spool_items",
            "Writes waiting in the local spool for the archive database (in order).",
            value=archive.spool_items,
        )
        yield GaugeMetricFamily(
            "sustain_archive_spool_bytes",
            "Size of the payloads waiting in the local spool.",
            value=archive.spool_bytes,
        )
        if archive.spool_oldest_timestamp is not None:
            yield GaugeMetricFamily(
                "sustain_archive_spool_oldest_timestamp_seconds",
                "Unix time the oldest write waiting in the spool was made; absent when empty.",
                value=archive.spool_oldest_timestamp,
            )
        yield CounterMetricFamily(
            "sustain_archive_spool_rejected",
            "Spooled writes the database refused for good (kept in the spool's rejected table).",
            value=archive.rejected,
        )
        yield GaugeMetricFamily(
            "sustain_archive_up",
            "1 while the archive database is open and its last write succeeded; 0 while it is "
            "out of reach (writes wait in the spool).",
            value=1.0 if archive.up else 0.0,
        )
        yield GaugeMetricFamily(
            "sustain_archive_writer_up",
            "1 while the thread that writes the spool to the database runs (see /healthz).",
            value=1.0 if archive.writer_running else 0.0,
        )
        yield GaugeMetricFamily(
            "sustain_archive_memory_items",
            "Writes held in memory because the spool could not take them (a full disk, a lock).",
            value=archive.memory_items,
        )
        yield CounterMetricFamily(
            "sustain_archive_spool_errors",
            "Failed reads and writes of the local spool (retried; writes held in memory).",
            value=archive.spool_errors,
        )
        lost = CounterMetricFamily(
            "sustain_archive_lost",
            "Records dropped without reaching the archive, by kind of write (rollups and events "
            "in rows, others one per write): the memory queue overflowed while the spool could "
            "not be written.",
            labels=["kind"],
        )
        # Every kind from 0, so that increase() sees the first loss (a counter that appears at
        # N has no increase to show).
        for kind in sorted(set(ARCHIVE_KINDS) | set(archive.lost)):
            lost.add_metric([kind], archive.lost.get(kind, 0))
        yield lost


def _stack_families(status: StackStatus) -> Iterator[Metric]:
    if status.stack_id is not None:
        info = GaugeMetricFamily(
            "sustain_stack_info",
            "The software stack probes run on now (value 1); stack_id is its content hash.",
            labels=["stack_id", *(label for label, _ in INFO_LABELS)],
        )
        info.add_metric(
            [status.stack_id, *(status.labels.get(label, "") for label, _ in INFO_LABELS)], 1.0
        )
        yield info
    yield CounterMetricFamily(
        "sustain_stack_changes",
        "Stack changes seen by this agent (the first stack a node records counts as one).",
        value=status.changes,
    )
    if status.last_change_timestamp is not None:
        yield GaugeMetricFamily(
            "sustain_stack_last_change_timestamp_seconds",
            "Unix time this agent last saw the stack change.",
            value=status.last_change_timestamp,
        )


def _drift_families(status: DriftStatus) -> Iterator[Metric]:
    runs = CounterMetricFamily(
        "sustain_drift_runs", "Runs of the drift detection, by outcome.", labels=["outcome"]
    )
    for outcome in ("ok", "failed"):
        runs.add_metric([outcome], status.runs.get(outcome, 0))
    yield runs
    if status.last_run is not None:
        yield GaugeMetricFamily(
            "sustain_drift_last_run_timestamp_seconds",
            "Unix time the drift detection last ran.",
            value=status.last_run,
        )
    labels = [*SERIES_LABELS, "direction", "cause"]
    ratio = GaugeMetricFamily(
        "sustain_drift_last_change_ratio",
        "The latest lasting change of a probe's steady throughput: mean after / mean before.",
        labels=labels,
    )
    when = GaugeMetricFamily(
        "sustain_drift_last_change_timestamp_seconds",
        "Unix time of the first result after the latest change.",
        labels=labels,
    )
    for key, drift in sorted(status.latest.items()):
        values = [*key, drift["direction"], drift["cause"]]
        ratio.add_metric(values, drift["after"] / drift["before"] if drift["before"] else 0.0)
        when.add_metric(values, datetime.fromisoformat(drift["at"]).timestamp())
    yield ratio
    yield when
    fleet = GaugeMetricFamily(
        "sustain_drift_fleet_ratio",
        "Recent steady throughput over the median of identical devices (model, stack, probe).",
        labels=SERIES_LABELS,
    )
    flagged = GaugeMetricFamily(
        "sustain_drift_fleet_outlier",
        "1 when the device is more than drift.outlier_ratio below its peers' median.",
        labels=SERIES_LABELS,
    )
    for key, outlier in sorted(status.fleet.items()):
        fleet.add_metric(list(key), outlier["ratio"])
        flagged.add_metric(list(key), 1.0 if outlier["outlier"] else 0.0)
    yield fleet
    yield flagged
