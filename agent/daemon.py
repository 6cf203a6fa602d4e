"""The agent's lifecycle: start everything in an order that fails early, stop it within seconds.

Start-up binds the exporter's port first (so that a port in use is reported before any database
file or directory is created), then opens the archive (a bad database is the likeliest mistake),
then starts the sampler loops and the scheduler. A mistake in the configuration (a port in use, a
bad URL, a missing driver, an archive newer than this agent) is a ``StartupError`` with one
readable line; the CLI turns it into exit code 2. A database that cannot be reached or written at
start (a server down, a full disk) is not: the agent serves /metrics and its live health, keeps
its writes in the spool, and opens the archive in the background with a back-off; what needs the
archive at start (the spool's replay, marking interrupted runs aborted, the last results, stack
and health records) runs when it opens. On SIGTERM or SIGINT the loops stop, the
scheduler finishes its running job, the finished rollup periods are written, and the process
exits 0.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from types import FrameType

import psutil
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry
from prometheus_client.process_collector import ProcessCollector
from sqlalchemy.exc import SQLAlchemyError

from agent.archive.database import (
    ArchiveError,
    ArchiveUnavailable,
    check_engine,
    current_revision,
    make_engine,
    upgrade,
)
from agent.archive.job import ArchiveJob, LocalRollups
from agent.archive.probe_runs import latest_results
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool
from agent.archive.stack_snapshots import StackNotFound, StoredStack, find, last_stack
from agent.config.settings import Settings, redact_url
from agent.datadir_lock import DataDirInUse, DataDirLock
from agent.drift.job import DriftJob
from agent.exporter.metrics import AgentMetrics
from agent.exporter.server import ExporterApp, ExporterServer, ListenError
from agent.health import records
from agent.health.monitor import HealthMonitor, pci_gpus
from agent.occupancy.tracker import Occupancy
from agent.probes.devices import TelemetryCapture
from agent.probes.runner import ProbeRunner
from agent.probes.scheduler import ProbeScheduler
from agent.probes.status import ProbeKey, ProbeResult
from agent.stack.tracker import StackTracker
from agent.telemetry.rollup import RollupBuilder
from agent.telemetry.sampler import LoopStatus, SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Collector, Event, Field, Sample
from collectors.host import HostCollector
from collectors.nvml.collector import NvmlCollector
from collectors.nvml.library import NvmlLibrary
from collectors.processes import ProcessCpuMeter

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 3.0
SPOOL_DRAIN_SECONDS = 5.0  # at shutdown; what is left waits in the spool for the next start
STARTUP_REPLAY_SECONDS = 30.0
OPEN_RETRY_SECONDS = (1.0, 60.0)  # the background open's back-off, first and longest
SWITCH_INTERVAL_SECONDS = 0.001
CLEARS_POLL_SECONDS = 5.0  # how soon `sustain health clear` reaches a running agent
DAY = 86_400.0


class StartupError(Exception):
    """The agent cannot start; the message is one line for the operator."""


def build_collectors(settings: Settings, runner: ProbeRunner) -> list[Collector]:
    collectors: list[Collector] = []
    if settings.host.enabled:
        collectors.append(HostCollector(procfs=settings.host.procfs, sysfs=settings.host.sysfs))
    if settings.nvml.enabled:
        library = NvmlLibrary(absent_retry_seconds=settings.nvml.absent_retry_seconds)
        collectors.append(NvmlCollector(own_pids=runner.child_pids, library=library))
    return collectors


class Agent:
    """One running agent: collectors, sampler loops, scheduler, exporter and archive."""

    def __init__(
        self,
        settings: Settings,
        stop: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self._stop = stop or threading.Event()
        self.runner = ProbeRunner(
            python=settings.probing.python,
            startup_timeout_seconds=settings.probing.startup_timeout_seconds,
            grace_seconds=settings.probing.run_grace_seconds,
        )
        self.collectors = build_collectors(settings, self.runner)
        catalogue: dict[str, dict[str, Field]] = {
            collector.name: dict(collector.fields) for collector in self.collectors
        }
        self.store = TelemetryStore(settings.sampler.buffer_samples)
        self.rollups = RollupBuilder(catalogue, settings.archive.rollup_seconds, time.time())
        # A fleet's PostgreSQL gets only coarse rollups, if any (docs/scale.md); the node keeps
        # its own of rollup_seconds in a SQLite file (see _open_local_rollups).
        fleet_period = settings.archive.fleet_rollup_seconds
        self.coarse_rollups = (
            RollupBuilder(catalogue, fleet_period, time.time())
            if settings.fleet_archive and fleet_period is not None
            else None
        )
        self.local: LocalRollups | None = None

        url = settings.database_url
        node = settings.agent.node
        # The exporter binds before the archive is touched: a port in use is reported before a
        # SQLite file or its directory is created. It serves once start() runs.
        registry = CollectorRegistry(auto_describe=False)
        host, port = settings.listen_address
        try:
            self.server = ExporterServer(
                host,
                port,
                ExporterApp(
                    registry,
                    self.loop_statuses,
                    node=node,
                    # The monitor and the scheduler are built below; the page is served after.
                    health=(lambda: [] if self.health is None else self.health.verdicts())
                    if settings.health.enabled
                    else None,
                    probes=lambda: self.probes.status(),  # noqa: PLW0108 - probes come later
                    docs_url=settings.exporter.docs_url,
                    telemetry=self.store.latest,
                    archive_writer=lambda: self.archive_job.status().writer_running,
                ),
                web_config_file=settings.exporter.web_config_file,
                header_timeout_seconds=settings.exporter.header_timeout_seconds,
                max_connections=settings.exporter.max_connections,
                auth_rate_per_second=settings.exporter.auth_rate_per_second,
            )
        except ListenError as exc:
            raise StartupError(str(exc)) from None
        try:
            stored, restored = self._open_archive(url, node)
        except StartupError:
            self.server.stop()
            raise
        self.archive_job = ArchiveJob(
            self.rollups,
            self.sink,
            settings.archive.retention_days,
            events_retention_days=settings.archive.events_retention_days,
            probe_runs_retention_days=settings.archive.probe_runs_retention_days,
            local=self.local,
        )
        nvml = next((c for c in self.collectors if isinstance(c, NvmlCollector)), None)
        self.stacks = StackTracker(
            self.sink,
            nvml=None if nvml is None else nvml.library,
            python=self.runner.python,
            previous=None if stored is None else (stored.stack_id, stored.facts),
            container_image=settings.stack.container_image,
        )
        self.drift = DriftJob(settings.drift, url, node, self.sink, settings.health.baseline_days)

        self.capture = TelemetryCapture()
        self.occupancy = Occupancy(settings.occupancy, settings.host.procfs)
        self.health = self._health_monitor(node) if settings.health.enabled else None
        self.loops = [
            SamplerLoop(
                collector,
                settings.sampler.interval_seconds,
                sinks=(
                    self.store.record,
                    self.rollups.add,
                    *(() if self.coarse_rollups is None else (self.coarse_rollups.add,)),
                    self.occupancy.record,
                    self._archive_events,
                    self.capture.record,
                    *(() if self.health is None else (self.health.record,)),
                ),
                stall_seconds=settings.sampler.stall_seconds,
            )
            for collector in self.collectors
        ]
        self.probes = ProbeScheduler(
            settings.probing,
            self.runner,
            self.store,
            self.capture,
            self.loops,
            settings.sampler.interval_seconds,
            writer=self.sink,
            stacks=self.stacks,
            processes=ProcessCpuMeter(settings.host.procfs),
        )
        if self.probes.restore(restored):
            log.info("restored the latest result of %d probe(s) from the archive", len(restored))
        self._clears_since = psutil.boot_time()
        self._clears_seen: set[str] = set()
        self.probes.occupants = lambda key: ", ".join(
            occupant.describe() for occupant in self.occupancy.occupants(key)
        )
        if self.health is not None:
            self.probes.listeners.append(self.health.probe_run)
            self._restore_health()
        registry.register(
            AgentMetrics(
                self.store,
                catalogue,
                self.loop_statuses,
                settings.exporter.window_seconds,
                archive=self.archive_job.status,
                probes=self.probes.status,
                stack=self.stacks.status,
                drift=self.drift.status if settings.drift.enabled else None,
                occupancy=self.occupancy.status,
                health=None if self.health is None else self.health.verdicts,
            )
        )
        # prometheus_client's collector, not psutil: it reads /proc/self, which is the agent in any
        # pid namespace, where psutil.Process() would look up os.getpid() under host.procfs (the
        # host's pids in a container); and process_cpu_seconds_total keeps its usual meaning, the
        # agent's own overhead without the probes' deliberate load.
        ProcessCollector(namespace="sustain", registry=registry)
        self.scheduler = self._scheduler(settings)
        log.info(
            "sustain ready: node %s, collectors %s, archive %s, listening on %s:%d",
            settings.agent.node,
            ",".join(collector.name for collector in self.collectors) or "none",
            redact_url(url),
            host,
            self.server.port,
        )

    def _health_monitor(self, node: str) -> HealthMonitor:
        return HealthMonitor(
            self.settings.health,
            self._health_event,
            baseline=lambda identity, device, since: records.baseline(
                self._engine, identity, node, device, since
            ),
            couplings=lambda: self.probes.couplings(),  # noqa: PLW0108 - probes come later
            cpu=self.settings.host.enabled,
            loops=lambda: self.loop_statuses(),  # noqa: PLW0108 - the loops come later
            pci_gpus=pci_gpus(self.settings.host.sysfs) if self.settings.nvml.enabled else (),
            known=lambda: records.known_devices(self._engine, node),
            recorded=lambda: records.last_states(self._engine, node),
        )

    def _open_archive(
        self, url: str, node: str
    ) -> tuple[StoredStack | None, list[tuple[ProbeKey, float, ProbeResult]]]:
        """Make the engine and the sink, then open the archive (``_open_now``); return the stack
        this node last ran on and the latest result of each of its probes. Only a mistake in the
        configuration raises; an archive out of reach is opened later (``_open_later``)."""
        settings = self.settings
        try:
            self._engine = make_engine(url)
        except ArchiveUnavailable:
            self._engine = make_engine(url, create_directory=False)
        except ArchiveError as exc:
            raise StartupError(str(exc)) from None
        self.sink = ArchiveSink(self._engine, node, Spool(settings.spool_path), ready=False)
        if self._engine.dialect.name == "postgresql":
            self.local = self._open_local_rollups(node)
        try:
            return self._open_now()
        except ArchiveUnavailable as exc:
            log.error(
                "%s; serving metrics and keeping archive writes in %s until it opens "
                "(retried in the background)",
                exc,
                settings.spool_path,
            )
        except ArchiveError as exc:
            raise StartupError(str(exc)) from None
        return None, []

    def _open_now(self) -> tuple[StoredStack | None, list[tuple[ProbeKey, float, ProbeResult]]]:
        """Connect, upgrade, replay the spool, mark interrupted runs aborted, read what the probe
        gauges and the stack tracker start from. ArchiveUnavailable while out of reach."""
        check_engine(self._engine)
        if self.settings.archive.auto_upgrade:
            before = current_revision(self._engine)
            upgrade(self._engine)
            after = current_revision(self._engine)
            if after != before:
                log.info("archive schema upgraded from %s to %s", before or "empty", after)
        self.sink.ready.set()
        # What the last run left in the spool goes first, so that its probe runs are complete
        # before the unfinished ones are marked aborted.
        if not self.sink.drain(deadline=time.monotonic() + STARTUP_REPLAY_SECONDS):
            log.warning("the spool is not empty yet: replaying it in the background")
        try:
            aborted = self.sink.probe_runs.abort_unfinished()
            # The probe gauges show the last results from the start, not only after the next run.
            restored = latest_results(self._engine, self.settings.agent.node)
            previous = last_stack(self._engine, self.settings.agent.node)
            stored = find(self._engine, previous) if previous is not None else None
        except StackNotFound:
            stored = None
        except (ArchiveError, SQLAlchemyError) as exc:
            log.warning("archive opened, but the last results cannot be read: %s", exc)
            return None, []
        if aborted:
            log.warning(
                "%d probe run(s) were interrupted by the last stop: recorded as aborted", aborted
            )
        return stored, restored

    def _open_later(self) -> None:
        """The archive was out of reach at start: try again with a back-off until it opens."""
        backoff, longest = OPEN_RETRY_SECONDS
        while not self._stop.wait(backoff):
            try:
                _, restored = self._open_now()
            except ArchiveUnavailable as exc:
                log.debug("archive still out of reach: %s", exc)
                backoff = min(longest, backoff * 2)
                continue
            except ArchiveError as exc:
                log.error("archive cannot be used: %s (restart once it is fixed)", exc)
                return
            log.info(
                "archive %s opened; replaying the spool", redact_url(self.settings.database_url)
            )
            if self.probes.restore(restored):
                log.info(
                    "restored the latest result of %d probe(s) from the archive", len(restored)
                )
            if self.health is not None:
                self._restore_health()
            self.sink.wake()
            return

    def _open_local_rollups(self, node: str) -> LocalRollups:
        """The node-local SQLite archive of a fleet agent's rollups, migrated, its spool
        replayed. It holds the same schema as any archive; only rollups are written to it.
        A local file that cannot be written now (a full disk) keeps its rollups in its spool."""
        settings = self.settings
        try:
            engine = make_engine(settings.local_database_url)
        except ArchiveError as exc:
            raise StartupError(str(exc)) from None
        sink = ArchiveSink(engine, node, Spool(settings.local_spool_path), ready=False)
        try:
            check_engine(engine)
            upgrade(engine)
        except ArchiveError as exc:
            log.error("%s; the local rollups wait in %s", exc, settings.local_spool_path)
        else:
            sink.ready.set()
            sink.drain(deadline=time.monotonic() + STARTUP_REPLAY_SECONDS)
        log.info(
            "rollups of %d s stay on this node in %s; the fleet database gets %s",
            settings.archive.rollup_seconds,
            redact_url(settings.local_database_url),
            "none"
            if self.coarse_rollups is None
            else f"rollups of {settings.archive.fleet_rollup_seconds} s",
        )
        return LocalRollups(sink, self.coarse_rollups)

    def _scheduler(self, settings: Settings) -> BackgroundScheduler:
        scheduler = BackgroundScheduler(timezone="UTC")
        scheduler.add_job(
            self.archive_job.run,
            "interval",
            seconds=min(10, settings.archive.rollup_seconds),
            id="rollups",
            max_instances=1,
            coalesce=True,
        )
        scheduler.add_job(
            self.archive_job.apply_retention,
            "interval",
            hours=1,
            id="retention",
            max_instances=1,
            coalesce=True,
        )
        scheduler.add_job(
            self.stacks.refresh,
            "interval",
            seconds=settings.stack.interval_seconds,
            id="stack",
            max_instances=1,
            coalesce=True,
            next_run_time=datetime.now(UTC),
        )
        if settings.drift.enabled:
            scheduler.add_job(
                self.drift.run,
                "interval",
                seconds=settings.drift.interval_seconds,
                id="drift",
                max_instances=1,
                coalesce=True,
                next_run_time=datetime.now(UTC)
                + timedelta(seconds=min(60.0, settings.drift.interval_seconds)),
            )
        if settings.probing.enabled:
            self.probes.schedule(scheduler)
        if self.health is not None:
            scheduler.add_job(
                self.poll_clears,
                "interval",
                seconds=CLEARS_POLL_SECONDS,
                id="health-clears",
                max_instances=1,
                coalesce=True,
            )
        return scheduler

    def _restore_health(self) -> None:
        """What the archive holds since the node booted: XIDs, recent results for the baseline,
        operators' acknowledgements. Until the archive opens, nothing (_open_later calls it)."""
        assert self.health is not None
        if not self.sink.ready.is_set():
            return
        settings = self.settings.health
        node = self.settings.agent.node
        boot = self._clears_since
        try:
            self.health.restore(
                records.xids(self._engine, node, boot),
                records.own_results(
                    self._engine, node, settings.baseline_runs, time.time() - DAY * 365
                ),
            )
        except SQLAlchemyError as exc:
            log.warning("health: cannot restore XIDs and results from the archive: %s", exc)
        self.poll_clears()

    def poll_clears(self) -> None:
        """Operators' acknowledgements (``sustain health clear``) reach the monitor through the
        archive, so that they work with or without the daemon running."""
        if self.health is None or not self.sink.ready.is_set():
            return
        try:
            found = records.clears(self._engine, self.settings.agent.node, self._clears_since)
        except SQLAlchemyError as exc:
            log.warning("health: cannot read acknowledgements from the archive: %s", exc)
            return
        for clear in found:
            if clear.id not in self._clears_seen:
                self._clears_seen.add(clear.id)
                self.health.acknowledge(clear)

    def _health_event(self, event: Event) -> None:
        self._archive_events(Sample("health", event.device, event.timestamp, (), events=(event,)))

    def _archive_events(self, sample: Sample) -> None:
        """Sampler sink: the sample's events, with who was running on their devices."""
        self.archive_job.add_events(self.occupancy.enrich(sample))

    def loop_statuses(self) -> list[LoopStatus]:
        return [loop.status() for loop in self.loops]

    def start(self) -> None:
        # What start-up built (modules, SQLAlchemy's and pydantic's tables, the settings) lives as
        # long as the process: moved out of the collector's reach, a full collection no longer
        # walks it. Measured on an 8-GPU exposition: 50-80 ms pauses every few hundred scrapes
        # before, 0.2 ms after (docs/performance.md); a scrape or a poll no longer waits on them.
        gc.collect()
        gc.freeze()
        # The GIL passes between threads every 5 ms by default: a scrape or a poll that wakes
        # while the archive job writes a minute of rollups waited in 5 ms steps. Every 1 ms, the
        # exporter and the sampler keep their latency beside background work (docs/performance.md).
        sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
        self.sink.start_draining()
        if self.local is not None:
            self.local.sink.start_draining()
        if not self.sink.ready.is_set():
            threading.Thread(target=self._open_later, name="archive-open", daemon=True).start()
        self.occupancy.start()
        for loop in self.loops:
            loop.start()
        self.scheduler.start()
        self.server.start()

    def wait(self) -> None:
        while not self._stop.wait(1.0):
            pass

    def stop(self) -> None:
        """Stop sampling, write every finished rollup period, release everything."""
        started = time.monotonic()
        for loop in self.loops:
            loop.request_stop()
        deadline = started + STOP_GRACE_SECONDS
        for loop in self.loops:
            if not loop.join(max(0.0, deadline - time.monotonic())):
                log.warning("sampler loop %s did not stop in time", loop.collector.name)
        self.occupancy.stop()
        self.probes.stop()  # a running probe would hold up the scheduler's shutdown
        self.scheduler.shutdown(wait=True)
        self.archive_job.run()
        if not self.sink.stop(SPOOL_DRAIN_SECONDS):
            status = self.sink.status()
            log.warning(
                "%d archive writes (%d rollup rows, %d events) stay in the spool %s and are "
                "replayed at the next start%s",
                status.spool_items,
                status.pending_rows,
                status.pending_events,
                self.sink.spool.path,
                f"; {status.memory_items} held in memory are lost (the spool cannot take them)"
                if status.memory_items
                else "",
            )
        self.sink.spool.close()
        if self.local is not None:
            if not self.local.sink.stop(SPOOL_DRAIN_SECONDS):
                log.warning(
                    "local rollups stay in the spool %s until the next start",
                    self.local.sink.spool.path,
                )
            self.local.sink.spool.close()
            self.local.sink.engine.dispose()
        self.server.stop()
        for collector in self.collectors:
            collector.close()
        self._engine.dispose()
        log.info("sustain stopped in %.2f s", time.monotonic() - started)


def run(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; return the process exit code."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    # Installed before start-up, so a signal during migrations still ends in an orderly stop.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lock = DataDirLock(settings.agent.data_dir)
    try:
        lock.acquire()
    except DataDirInUse as exc:
        raise StartupError(str(exc)) from None
    try:
        agent = Agent(settings, stop=stop)
    except BaseException:
        lock.abandon()
        raise
    try:
        agent.start()
        agent.wait()
        agent.stop()
    finally:
        lock.release()
    return 0
