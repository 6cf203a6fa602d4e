"""The agent's lifecycle: start everything in an order that fails early, stop it within seconds.

Start-up binds the exporter's port first (so that a port in use is reported before any database
file or directory is created), then opens the archive (a bad database is the likeliest mistake),
then starts the sampler loops and the scheduler. Any start-up failure is a ``StartupError`` with
one readable line; the CLI turns it into exit code 2. On SIGTERM or SIGINT the loops stop, the
scheduler finishes its running job, the finished rollup periods are written, and the process
exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from datetime import UTC, datetime, timedelta
from types import FrameType

from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry
from prometheus_client.process_collector import ProcessCollector

from agent.archive.database import ArchiveError, current_revision, open_engine, upgrade
from agent.archive.job import ArchiveJob
from agent.archive.probe_runs import latest_results
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool, SpoolError
from agent.archive.stack_snapshots import StackNotFound, StoredStack, find, last_stack
from agent.config.settings import Settings, redact_url
from agent.drift.job import DriftJob
from agent.exporter.metrics import AgentMetrics
from agent.exporter.server import ExporterApp, ExporterServer, ListenError
from agent.probes.devices import TelemetryCapture
from agent.probes.runner import ProbeRunner
from agent.probes.scheduler import ProbeKey, ProbeResult, ProbeScheduler
from agent.stack.tracker import StackTracker
from agent.telemetry.rollup import RollupBuilder
from agent.telemetry.sampler import LoopStatus, SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Collector, Field
from collectors.host import HostCollector
from collectors.nvml.collector import NvmlCollector
from collectors.processes import ProcessCpuMeter

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 3.0
SPOOL_DRAIN_SECONDS = 5.0  # at shutdown; what is left waits in the spool for the next start
STARTUP_REPLAY_SECONDS = 30.0


class StartupError(Exception):
    """The agent cannot start; the message is one line for the operator."""


def build_collectors(settings: Settings, runner: ProbeRunner) -> list[Collector]:
    collectors: list[Collector] = []
    if settings.host.enabled:
        collectors.append(HostCollector(procfs=settings.host.procfs, sysfs=settings.host.sysfs))
    if settings.nvml.enabled:
        collectors.append(NvmlCollector(own_pids=runner.child_pids))
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
        )
        self.collectors = build_collectors(settings, self.runner)
        catalogue: dict[str, dict[str, Field]] = {
            collector.name: dict(collector.fields) for collector in self.collectors
        }
        self.store = TelemetryStore(settings.sampler.buffer_samples)
        self.rollups = RollupBuilder(catalogue, settings.archive.rollup_seconds, time.time())

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
                ExporterApp(registry, self.loop_statuses),
                web_config_file=settings.exporter.web_config_file,
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
        )
        nvml = next((c for c in self.collectors if isinstance(c, NvmlCollector)), None)
        self.stacks = StackTracker(
            self.sink,
            nvml=None if nvml is None else nvml.library,
            python=self.runner.python,
            previous=None if stored is None else (stored.stack_id, stored.facts),
            container_image=settings.stack.container_image,
        )
        self.drift = DriftJob(settings.drift, url, node, self.sink)

        self.capture = TelemetryCapture()
        self.loops = [
            SamplerLoop(
                collector,
                settings.sampler.interval_seconds,
                sinks=(
                    self.store.record,
                    self.rollups.add,
                    self.archive_job.add_events,
                    self.capture.record,
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

    def _open_archive(
        self, url: str, node: str
    ) -> tuple[StoredStack | None, list[tuple[ProbeKey, float, ProbeResult]]]:
        """Open and upgrade the archive, replay the spool, mark interrupted runs aborted; return
        the stack this node last ran on and the latest result of each of its probes."""
        settings = self.settings
        try:
            self._engine = open_engine(url)
            if settings.archive.auto_upgrade:
                before = current_revision(self._engine)
                upgrade(self._engine)
                after = current_revision(self._engine)
                if after != before:
                    log.info("archive schema upgraded from %s to %s", before or "empty", after)
            self.sink = ArchiveSink(self._engine, node, Spool(settings.spool_path))
            # What the last run left in the spool goes first, so that its probe runs are complete
            # before the unfinished ones are marked aborted.
            if not self.sink.drain(deadline=time.monotonic() + STARTUP_REPLAY_SECONDS):
                log.warning("the spool is not empty yet: replaying it in the background")
            aborted = self.sink.probe_runs.abort_unfinished()
            # The probe gauges show the last results from the start, not only after the next run.
            restored = latest_results(self._engine, node)
            previous = last_stack(self._engine, node)
            stored = find(self._engine, previous) if previous is not None else None
        except (ArchiveError, SpoolError) as exc:
            raise StartupError(str(exc)) from None
        except StackNotFound:
            stored = None
        if aborted:
            log.warning(
                "%d probe run(s) were interrupted by the last stop: recorded as aborted", aborted
            )
        return stored, restored

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
        return scheduler

    def loop_statuses(self) -> list[LoopStatus]:
        return [loop.status() for loop in self.loops]

    def start(self) -> None:
        self.sink.start_draining()
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
        self.probes.stop()  # a running probe would hold up the scheduler's shutdown
        self.scheduler.shutdown(wait=True)
        self.archive_job.run()
        if not self.sink.stop(SPOOL_DRAIN_SECONDS):
            status = self.sink.status()
            log.warning(
                "%d archive writes (%d rollup rows, %d events) stay in the spool %s and are "
                "replayed at the next start",
                status.spool_items,
                status.pending_rows,
                status.pending_events,
                self.sink.spool.path,
            )
        self.sink.spool.close()
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
    agent = Agent(settings, stop=stop)
    agent.start()
    agent.wait()
    agent.stop()
    return 0
