"""The simulated fleet of bench/fleet_scale.py: its constants, what a node hands over (probe
runs, events, rollups, stacks) and one simulated agent's process, and the database helpers
both of its modes use (bench/fleet_results.py is the other)."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import random
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text

from agent.archive.database import open_engine
from agent.archive.sink import ArchiveSink
from agent.archive.spool import Spool, SpoolItem
from agent.config.settings import ProbingSection
from agent.probes.analysis import RunAnalysis
from agent.probes.attribution import Attribution, SegmentTelemetry
from agent.probes.protocol import Iteration
from agent.probes.runner import ProbeDevice, ProbeRun, ProbeSpec
from agent.reports.specs import spec_peak
from agent.telemetry.rollup import RollupRow
from collectors.base import Event
from collectors.nvml.collector import NvmlCollector

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
POSTGRES_MAINTENANCE_URL = f"{POSTGRES_SERVER}/test"
TRAFFIC_DATABASE = "sustain_fleet_bench"
RESULTS_DATABASE = "sustain_fleet_results"

HOUR = 3600.0
DAY = 86_400.0
# Per node, beyond the probe plan: assumptions, stated in the output.
THROTTLE_PER_GPU_HOUR = 6.0
HEALTH_PER_NODE_DAY = 2.0
XID_PER_NODE_DAY = 1 / 7
STACK_CHANGES_PER_NODE_DAY = 1 / 30
FAILED_SHARE = 0.03
# Iterations a second of each probe on an H100 (10 repeats of 8192^3 per matmul iteration, 10
# passes over 2 GiB arrays per membw one); other probes 30.
ITERATIONS_PER_SECOND = {("matmul", "bf16"): 60.0, ("matmul", "fp32"): 6.0, ("membw", "fp32"): 70.0}
HOST_ROLLUP_SERIES = 40
DRAIN_TIMEOUT_S = 600.0

MODELS = (  # a 10,000-node fleet: model, share of the nodes
    ("NVIDIA H100 80GB HBM3", 0.40),
    ("NVIDIA H200", 0.15),
    ("NVIDIA A100-SXM4-80GB", 0.30),
    ("NVIDIA L40S", 0.15),
)
STACKS = tuple(f"{index:x}" * 64 for index in range(10, 14))
STACK_FACTORS = (1.0, 1.02, 0.97, 1.03)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
EFFICIENCY = {"fp32": 0.8, "tf32": 0.6, "bf16": 0.7, "fp16": 0.7, "fp8": 0.6, "int8": 0.65}
FLEET_NODES = 10_000
GPUS = 8
RESULT_DAYS = 90
LOAD_CHUNK = 1_000_000


# The traffic of one node ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedProbe:
    workload: str
    precision: str
    optimization: str
    duration_seconds: float
    interval_seconds: float
    unit: str


def default_plan() -> list[PlannedProbe]:
    """The embedded default plan, one entry per variant (interval plans; cron ones are skipped)."""
    plan = []
    for entry in ProbingSection().plan:
        if entry.interval_seconds is None:
            continue
        unit = "B/s" if entry.workload == "membw" else "FLOP/s"
        for precision in entry.precisions:
            for optimization in entry.optimizations:
                plan.append(
                    PlannedProbe(
                        entry.workload,
                        precision,
                        optimization,
                        entry.duration_seconds,
                        entry.interval_seconds,
                        unit,
                    )
                )
    return plan


def rates(gpus: int) -> dict[str, float]:
    """What one node hands over per hour, by kind."""
    plan = default_plan()
    runs = gpus * sum(HOUR / probe.interval_seconds for probe in plan)
    iterations = gpus * sum(
        HOUR / p.interval_seconds * p.duration_seconds * iterations_per_second(p) for p in plan
    )
    return {
        "probe_runs": runs,
        "iterations": iterations,
        "throttle_episodes": gpus * THROTTLE_PER_GPU_HOUR,
        "health_changes": HEALTH_PER_NODE_DAY / 24,
        "xids": XID_PER_NODE_DAY / 24,
        "stack_changes": STACK_CHANGES_PER_NODE_DAY / 24,
        "rollup_rows": 60 * (gpus * len(NvmlCollector().fields) + HOST_ROLLUP_SERIES),
    }


def iterations_per_second(probe: PlannedProbe) -> float:
    return ITERATIONS_PER_SECOND.get((probe.workload, probe.precision), 30.0)


@dataclass(frozen=True, slots=True)
class Action:
    at: float  # node time, seconds from the agent's start
    kind: str  # start, finish, event, stack, rollups
    detail: Any = None


def poisson(rng: random.Random, rate_per_second: float, horizon: float) -> Iterator[float]:
    at = rng.expovariate(rate_per_second) if rate_per_second > 0 else horizon
    while at < horizon:
        yield at
        at += rng.expovariate(rate_per_second)


def schedule(index: int, horizon: float, gpus: int, with_rollups: bool) -> list[Action]:
    """One node's hand-overs over ``horizon`` seconds of node time, in time order."""
    rng = random.Random(index)
    actions = [Action(0.0, "stack", 0)]
    for gpu in range(gpus):
        for probe in default_plan():
            at = rng.uniform(0, probe.interval_seconds)
            while at < horizon:
                actions.append(Action(at, "start", (gpu, probe)))
                actions.append(Action(at + probe.duration_seconds, "finish", (gpu, probe)))
                at += probe.interval_seconds + rng.uniform(-150, 150)  # jitter around the grid
        for at in poisson(rng, THROTTLE_PER_GPU_HOUR / HOUR, horizon):
            actions.append(Action(at, "event", ("throttle_episode", gpu)))
    for kind, per_day in (
        ("health_change", HEALTH_PER_NODE_DAY),
        ("xid", XID_PER_NODE_DAY),
    ):
        for at in poisson(rng, per_day / DAY, horizon):
            actions.append(Action(at, "event", (kind, rng.randrange(gpus))))
    for at in poisson(rng, STACK_CHANGES_PER_NODE_DAY / DAY, horizon):
        actions.append(Action(at, "stack", rng.randrange(1, len(STACKS))))
    if with_rollups:
        actions += [Action(float(m), "rollups") for m in range(60, int(horizon) + 1, 60)]
    # A run started near the end is still going when the window closes: its finish never comes.
    return sorted((a for a in actions if a.at < horizon), key=lambda action: action.at)


# One agent ------------------------------------------------------------------------------------


class TimedSink(ArchiveSink):
    """The agent's sink, with the time of each spool item's apply and its wait since hand-over."""

    def __init__(self, engine: Engine, node: str, spool: Spool) -> None:
        super().__init__(engine, node, spool)
        self.apply_seconds: list[float] = []
        self.wait_seconds: list[float] = []
        self.last_applied = 0.0

    def _apply_one(self, item: SpoolItem) -> bool:
        started = time.perf_counter()
        done = super()._apply_one(item)
        finished = time.time()
        self.apply_seconds.append(time.perf_counter() - started)
        self.wait_seconds.append(finished - item.created)
        self.last_applied = finished
        return done


@dataclass
class Handed:
    """What one agent handed over, and what its sink reports at the end."""

    node: str
    runs: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    stacks: set[str] = field(default_factory=set)
    rollup_rows: int = 0
    items: int = 0
    rows: int = 0
    behind_seconds: float = 0.0  # how far the agent fell behind its schedule, at worst
    backlog_at_end: int = 0
    empty: bool = False
    rejected: int = 0
    write_errors: int = 0
    spool_items: int = 0
    apply_seconds: list[float] = field(default_factory=list)
    wait_seconds: list[float] = field(default_factory=list)
    last_applied: float = 0.0


def device_of(node: str, gpu: int) -> ProbeDevice:
    return ProbeDevice(
        "cuda", f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{gpu}')}", f"gpu{gpu}", gpu
    )


def model_of(index: int) -> str:
    position = (index * 0.618034) % 1.0  # spread the models over the agents
    for model, share in MODELS:
        if position < share:
            return model
        position -= share
    return MODELS[-1][0]


def stack_facts(stack: int) -> dict[str, Any]:
    return {
        "driver": {"version": f"550.{54 + stack}.15", "cuda_version": "12.4"},
        "torch": {"version": "2.5.1+cu124", "cuda": "12.4", "cudnn": 90100, "nccl": "2.21.5"},
        "python": "3.11.7",
        "kernel": "6.1.0-28-amd64",
        "os": "Debian GNU/Linux 12 (bookworm)",
        "container_image": f"registry.example.com/ml/train:2026.{stack + 1:02d}",
        "packages": {f"package-{n}": f"1.{n}.{stack}" for n in range(40)},
        "gpu": {"vbios": "96.00.99.00.01", "ecc": True, "mig": False},
    }


def probe_run(
    rng: random.Random, node: str, model: str, *, gpu: int, probe: PlannedProbe, started: float
) -> tuple[ProbeRun, RunAnalysis | None]:
    device = device_of(node, gpu)
    spec = ProbeSpec(
        probe.workload,
        probe.precision,
        probe.optimization,
        probe.duration_seconds,
        device,
        "default",
    )
    peak = spec_peak(model, probe.workload, probe.precision, probe.unit) or 1e14
    efficiency = 0.85 if probe.workload == "membw" else EFFICIENCY[probe.precision]
    steady = peak * efficiency * rng.gauss(1.0, 0.01)  # run-to-run noise of about 1 %
    ok = rng.random() >= FAILED_SHARE
    count = int(probe.duration_seconds * iterations_per_second(probe)) if ok else 7
    step = probe.duration_seconds / max(count, 1) if ok else 0.3
    phases = ("copy", "triad") if probe.workload == "membw" else ("measure",)
    iterations = []
    at = started + 1.5
    for i in range(count):
        seconds = step * rng.gauss(1.0, 0.01)
        work = steady * step
        iterations.append(Iteration(i, at, at + seconds, work, phases[i % len(phases)]))
        at += seconds
    manifest = {
        "event": "manifest",
        "workload": probe.workload,
        "version": 1,
        "precision": probe.precision,
        "optimization": probe.optimization,
        "size": "default",
        "unit": probe.unit,
        "work_unit": "byte" if probe.unit == "B/s" else "flop",
        "device": {"kind": "cuda", "label": device.label, "device_name": model, "memory": 85e9},
        "device_name": model,
        "parameters": {"m": 8192, "n": 8192, "k": 8192, "repeats": 10},
        "torch": "2.5.1+cu124",
        "cuda": "12.4",
        "duration": probe.duration_seconds,
    }
    ended = at if ok else started + 3.0
    if not ok:
        run = ProbeRun(
            uuid.uuid4().hex,
            spec,
            "failed",
            "probe exited 1: CUDA error: out of memory",
            started,
            ended,
            manifest,
            None,
            tuple(iterations),
            1,
            "RuntimeError: CUDA error: out of memory",
        )
        return run, None
    run = ProbeRun(
        uuid.uuid4().hex,
        spec,
        "ok",
        "",
        started,
        ended,
        manifest,
        {"event": "result", "throughput": steady * 1.01},
        tuple(iterations),
        0,
        "",
    )
    figures = {
        "classification": "flat",
        "n": count,
        "steady_start_index": 12,
        "steady_throughput": steady,
        "steady_ci": [steady * 0.999, steady * 1.001],
        "peak_throughput": steady * 1.04,
        "sustained_ratio": 1 / 1.04,
        "changepoints": [12],
        "warmup_seconds": 0.4,
        "mser5_index": 10,
        "outliers": 3,
        "tolerance": 0.02,
        "p10_throughput": steady * 0.99,
        "p50_throughput": steady,
        "reason": "one steady regime after 0.4 s of warm-up, within 2.0%",
        "phase": "measure",
    }
    segments = (
        SegmentTelemetry(started, started + 0.4, 4, {}, 1.98e9, 650.0, 60.0, 0.0),
        SegmentTelemetry(
            started + 0.4, ended, 196, {"sw_power_cap": 0.8}, 1.755e9, 700.0, 71.0, 0.0
        ),
    )
    attribution = Attribution(segments, None, steady / 700.0, "flat: no slowdown to explain")
    return run, RunAnalysis(figures, attribution)


def event(rng: random.Random, kind: str, node: str, gpu: int, at: float) -> Event:
    device = device_of(node, gpu).key
    if kind == "throttle_episode":
        seconds = rng.expovariate(1 / 20)
        return Event(
            kind,
            device,
            at,
            f"GPU {gpu}: sw_power_cap for {seconds:.1f} s",
            (
                ("reason", "sw_power_cap"),
                ("started", f"{at - seconds:.3f}"),
                ("seconds", f"{seconds:.3f}"),
            ),
        )
    if kind == "xid":
        return Event(kind, device, at, f"GPU {gpu}: XID 79", (("xid", "79"),))
    findings = json.dumps([{"reason": "pcie_link", "evidence": "Gen4 x8 of Gen5 x16 for 30 s"}])
    return Event(
        "health_change",
        device,
        at,
        f"gpu{gpu}: healthy -> degraded (pcie_link)",
        (
            ("state", "degraded"),
            ("previous", "healthy"),
            ("reasons", "pcie_link"),
            ("acknowledged", ""),
            ("device", f"gpu{gpu}"),
            ("uuid", device),
            ("name", f"GPU {gpu}"),
            ("findings", findings),
        ),
    )


def rollup_batch(node: str, gpus: int, period_start: float) -> list[RollupRow]:
    fields = list(NvmlCollector().fields)
    rows = [
        RollupRow(
            "nvml",
            device_of(node, gpu).key,
            name,
            "",
            "gauge",
            period_start,
            60,
            610.0,
            600.0,
            620.0,
            618.0,
            60,
        )
        for gpu in range(gpus)
        for name in fields
    ]
    rows += [
        RollupRow(
            "host",
            "host",
            "cpu_frequency_hertz",
            f"cpu={cpu}",
            "gauge",
            period_start,
            60,
            2.0e9,
            1.9e9,
            2.1e9,
            2.09e9,
            60,
        )
        for cpu in range(HOST_ROLLUP_SERIES)
    ]
    return rows


@dataclass(frozen=True, slots=True)
class AgentPlan:
    """What one agent process is told: who it is, where it writes, how fast its clock runs."""

    index: int
    url: str
    spool_path: Path
    seconds: float  # wall-clock length of the traffic
    compression: float  # node seconds per wall-clock second
    gpus: int
    rollups: bool


class SimulatedAgent:
    """One node's agent: its sink, and the hand-overs its schedule asks for."""

    def __init__(self, plan: AgentPlan) -> None:
        self.plan = plan
        self.node = f"fleet-node-{plan.index:05d}"
        self.rng = random.Random(plan.index + 1_000_000)
        self.model = model_of(plan.index)
        self.engine = open_engine(plan.url)
        self.sink = TimedSink(self.engine, self.node, Spool(plan.spool_path))
        self.handed = Handed(self.node)
        self.pending: dict[tuple[int, str], tuple[ProbeRun, RunAnalysis | None]] = {}
        self.stack = 0

    def hand_over(self, action: Action, at: float) -> None:
        """The action's write, handed to the sink as the daemon hands it; ``at`` in node time."""
        sink, handed = self.sink, self.handed
        handed.items += 1
        if action.kind == "start":
            gpu, probe = action.detail
            run, analysis = probe_run(
                self.rng, self.node, self.model, gpu=gpu, probe=probe, started=at
            )
            self.pending[gpu, probe.precision + probe.workload] = run, analysis
            sink.start(run.id, run.spec, run.started_at)
            handed.rows += 1
        elif action.kind == "finish":
            gpu, probe = action.detail
            run, analysis = self.pending.pop((gpu, probe.precision + probe.workload))
            sink.finish(run, analysis=analysis, stack_id=STACKS[self.stack])
            handed.runs.append(run.id)
            handed.rows += 2  # the run's row completed, and its series
        elif action.kind == "event":
            kind, gpu = action.detail
            happened = event(self.rng, kind, self.node, gpu, at)
            sink.add_events([happened])
            handed.events.append(happened.id)
            handed.rows += 1
        elif action.kind == "stack":
            self.stack = action.detail
            stack_id = STACKS[self.stack]
            sink.add_stack(stack_id, stack_facts(self.stack), at)
            summary = (("new", stack_id), ("old", ""), ("summary", "driver"))
            changed = Event("stack_changed", "node", at, f"stack {stack_id[:12]}", summary)
            sink.add_events([changed])
            handed.stacks.add(stack_id)
            handed.events.append(changed.id)
            handed.items += 1
            handed.rows += 2
        else:
            rows = rollup_batch(self.node, self.plan.gpus, at - 60)
            sink.add_rollups(rows)
            handed.rollup_rows += len(rows)
            handed.rows += len(rows)

    def finish(self) -> Handed:
        """Drain what is left, as the daemon does when it stops; what the sink reports."""
        handed, sink = self.handed, self.sink
        handed.backlog_at_end = sink.status().spool_items
        # Runs still going when the window closed: their finish never came (the start is written).
        handed.runs += [run.id for run, _ in self.pending.values()]
        handed.empty = sink.stop(DRAIN_TIMEOUT_S)
        status = sink.status()
        handed.rejected = status.rejected
        handed.write_errors = status.write_errors
        handed.spool_items = status.spool_items
        handed.apply_seconds, handed.wait_seconds = sink.apply_seconds, sink.wait_seconds
        handed.last_applied = sink.last_applied
        sink.spool.close()
        self.engine.dispose()
        return handed


def run_agent(plan: AgentPlan, start: Any, results: multiprocessing.connection.Connection) -> None:
    """One agent process: connect, wait at the start line, hand over its node's traffic on the
    compressed clock, drain, report. ``start`` is (a multiprocessing Event, a Value("d") that
    holds the wall time the traffic starts), set once every agent is ready."""
    agent = SimulatedAgent(plan)
    actions = schedule(plan.index, plan.seconds * plan.compression, plan.gpus, plan.rollups)
    agent.sink.start_draining()
    results.send("ready")
    ready, start_value = start
    ready.wait()
    start_at = float(start_value.value)
    node_origin = start_at - plan.seconds * plan.compression  # node time ends at wall time's now
    for action in actions:
        lag = time.time() - (start_at + action.at / plan.compression)
        if lag < 0:
            time.sleep(-lag)
        agent.handed.behind_seconds = max(agent.handed.behind_seconds, lag)
        agent.hand_over(action, node_origin + action.at)
    results.send(agent.finish())
    results.close()


# The traffic run ------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def create_database(name: str) -> None:
    admin = create_engine(POSTGRES_MAINTENANCE_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()


def drop_database(name: str) -> None:
    admin = create_engine(POSTGRES_MAINTENANCE_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
